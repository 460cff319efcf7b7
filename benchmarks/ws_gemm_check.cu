/* ws_gemm_check.cu: a stand-alone GPU check and timing of the WsGemm kernels through the C door
 * (kernels/kimi_kernels.h) alone, so the kernel can be judged before and apart from the Python
 * layer. Not part of the library build.
 *
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels \
 *        benchmarks/ws_gemm_check.cu kernels/ws_gemm.cu kernels/probe.cu -o /tmp/ws_gemm_check \
 *        [-DWITH_CUBLAS -lcublas] && /tmp/ws_gemm_check [--quick]
 *        [--check-only | --time-only [--force TILE_N,CLUSTER]] [--rounds R]
 *
 * 1. correctness against a double-precision host reference: plain and split epilogues, odd N,
 *    M across the launch boundaries (1..130), strided outputs, untouched padding and gap
 *    columns, no -0.0 written; every (tile_n, cluster) forced, including those the heuristic
 *    never picks; 2. bitwise determinism and batch invariance; 3. timing: CUDA graph
 *    of 8 GEMMs over 8 weight copies (L2 cannot serve them), median of replays / 8, with and
 *    without programmatic dependent launch, beside cuBLAS (with -DWITH_CUBLAS) and the HBM floor
 *    (kx_probe_read over 4 GiB); --rounds R puts the 8 copies R times into each graph, so a
 *    replay's own start (its first launch follows no kernel it could overlap) is shared by 8 R
 *    GEMMs instead of 8; 4. a (small WsGemm -> big WsGemm) chain with the big GEMM's programmatic
 *    dependent launch on and off.
 * Exit status 0 only when every correctness check passed.
 */
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "harness.cuh"
#include "kimi_kernels.h"
#ifdef WITH_CUBLAS
#include <cublas_v2.h>
#endif

static float bf2f(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static uint16_t f2bf(float f) { /* round to nearest even (finite inputs) */
  uint32_t u;
  memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}

static int failures = 0;

/* The arguments of a GEMM of x [m, k] (row stride x_row_stride) by w [n, k]; outputs are the caller's. */
static kx_gemm_args gemm_args(const kx_gemm_config &cfg, const uint16_t *w, int n, int k, const uint16_t *x,
                              int64_t x_row_stride, int m) {
  kx_gemm_args a;
  memset(&a, 0, sizeof(a));
  a.config = cfg;
  a.w = w;
  a.n = n;
  a.k = k;
  a.x = x;
  a.x_row_stride = x_row_stride;
  a.m = m;
  return a;
}

/* A configuration the heuristic may not pick: tile_n rows of W per cluster of `cluster` CTAs (no
 * change when tile_n is 0). kx_gemm_configure has set every kernel's shared-memory limit. */
static void force_config(kx_gemm_config *cfg, int n, int tile_n, int cluster) {
  if (tile_n <= 0) return;
  cfg->tile_n = tile_n;
  cfg->cluster = cluster;
  cfg->grid = (n + tile_n - 1) / tile_n * cluster;
}

/* ---- correctness --------------------------------------------------------------------- */
/* force_tile / force_cluster (0: kx_gemm_configure's choice) run a configuration the heuristic
 * may never pick on this GPU, so that every kernel instantiation is checked. */
static void check_case(int n, int k, int m, bool split, uint32_t seed, int force_tile = 0,
                       int force_cluster = 0) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> w((size_t)n * k), x((size_t)m * k);
  for (auto &v : w) v = f2bf(nd(rng) * 0.05f);
  for (auto &v : x) v = f2bf(nd(rng));
  /* row 0 of W: only the smallest negative bf16 subnormal, so its outputs are tiny and round
   * to -0.0 (or flush to -0.0): the epilogue must write +0.0 */
  for (int c = 0; c < k; ++c) w[c] = 0;
  w[0] = 0x8001u;

  kx_gemm_config cfg;
  int dev = 0;
  CHECK(cudaGetDevice(&dev));
  CHECK(kx_gemm_configure(n, k, dev, &cfg)); /* also sets every kernel's shared-memory limit */
  force_config(&cfg, n, force_tile, force_cluster);
  const int64_t xs = k + 8, ys = n + 5; /* strided x and outputs */
  std::vector<uint16_t> xh((size_t)m * xs, 0);
  for (int r = 0; r < m; ++r) memcpy(&xh[(size_t)r * xs], &x[(size_t)r * k], (size_t)k * 2);
  Dev dw((size_t)n * k * 2), dx((size_t)m * xs * 2 + 16), dy((size_t)m * ys * 4 + 16),
      dl((size_t)m * ys * 4 + 16);
  CHECK(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dx.p, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemset(dy.p, 0xEE, (size_t)m * ys * 4 + 16)); /* sentinel: untouched check */
  CHECK(cudaMemset(dl.p, 0xEE, (size_t)m * ys * 4 + 16));

  const int valid = split ? n / 3 : 0, splitc = split ? n / 2 : 0;
  kx_gemm_args a = gemm_args(cfg, dw.as<uint16_t>(), n, k, dx.as<uint16_t>(), xs, m);
  a.split_epilogue = split;
  if (!split) {
    a.y = dy.as<uint16_t>();
    a.y_row_stride = ys;
  } else {
    a.logits = dl.as<float>();
    a.logits_row_stride = ys;
    a.valid = valid;
    a.latent = dy.as<uint16_t>();
    a.latent_row_stride = ys;
    a.split = splitc;
  }
  CHECK(kx_gemm_run(&a, 0));
  CHECK(cudaDeviceSynchronize());
  std::vector<uint16_t> yh((size_t)m * ys * 2 + 8);
  std::vector<float> lh((size_t)m * ys + 4);
  CHECK(cudaMemcpy(yh.data(), dy.p, (size_t)m * ys * 2, cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(lh.data(), dl.p, (size_t)m * ys * 4, cudaMemcpyDeviceToHost));

  std::vector<float> wf(w.size()), xf(x.size());
  for (size_t i = 0; i < w.size(); ++i) wf[i] = bf2f(w[i]);
  for (size_t i = 0; i < x.size(); ++i) xf[i] = bf2f(x[i]);
  long bad = 0, negzero = 0, touched = 0;
  double worst = 0;
  for (int r = 0; r < m; ++r)
    for (int c = 0; c < (int)ys; ++c) {
      const bool plain_col = !split && c < n;
      const bool logit_col = split && c < valid;
      const bool latent_col = split && c >= splitc && c < n;
      double ref = 0, mag = 0;
      if (c < n) {
        const float *wr = &wf[(size_t)c * k], *xr = &xf[(size_t)r * k];
        for (int kk = 0; kk < k; ++kk) {
          const double t = (double)wr[kk] * xr[kk];
          ref += t;
          mag += fabs(t);
        }
      }
      const double tol_acc = 2e-5 * mag + 1e-30;
      if (plain_col || latent_col) {
        const size_t at = (size_t)r * ys + (plain_col ? c : c - splitc);
        const uint16_t b = yh[at];
        if (b == 0x8000u) ++negzero;
        const double err = fabs((double)bf2f(b) - ref);
        const double tol = tol_acc + fabs(ref) * (1.0 / 256);
        if (!(err <= tol)) {
          if (bad < 5) printf("    bf16 r=%d c=%d got %g ref %g\n", r, c, bf2f(b), ref);
          ++bad;
        }
        worst = std::max(worst, err / (fabs(ref) + 1e-6));
      }
      if (logit_col) {
        const float f = lh[(size_t)r * ys + c];
        uint32_t u;
        memcpy(&u, &f, 4);
        if (u == 0x80000000u) ++negzero;
        if (!(fabs((double)f - ref) <= tol_acc + fabs(ref) * 1e-6)) {
          if (bad < 5) printf("    fp32 r=%d c=%d got %g ref %g\n", r, c, f, ref);
          ++bad;
        }
      }
      /* everything else must still hold the sentinel: plain y past column n, logits past
       * `valid`, latent past n - split (c indexes the output row here) */
      if (!split && c >= n && yh[(size_t)r * ys + c] != 0xEEEEu) ++touched;
      if (split) {
        uint32_t u;
        memcpy(&u, &lh[(size_t)r * ys + c], 4);
        if (c >= valid && u != 0xEEEEEEEEu) ++touched;
        if (c >= n - splitc && yh[(size_t)r * ys + c] != 0xEEEEu) ++touched;
      }
    }
  const bool ok = bad == 0 && negzero == 0 && touched == 0;
  failures += !ok;
  printf("  %-5s N=%5d K=%5d M=%3d tile=%3d cluster=%d: %s (bad %ld, -0.0 %ld, touched %ld, "
         "max rel %.2e)\n",
         split ? "split" : "plain", n, k, m, cfg.tile_n, cfg.cluster, ok ? "ok" : "FAIL", bad,
         negzero, touched, worst);
}

/* ---- determinism and batch invariance -------------------------------------------------- */
static void check_invariance(int n, int k) {
  const int M = 130;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> w((size_t)n * k), x((size_t)M * k);
  for (auto &v : w) v = f2bf(nd(rng) * 0.05f);
  for (auto &v : x) v = f2bf(nd(rng));
  kx_gemm_config cfg;
  CHECK(kx_gemm_configure(n, k, 0, &cfg));
  Dev dw(w.size() * 2), dx(x.size() * 2), dy((size_t)M * n * 2);
  CHECK(cudaMemcpy(dw.p, w.data(), w.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dx.p, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  auto run = [&](int m, int row0) {
    kx_gemm_args a = gemm_args(cfg, dw.as<uint16_t>(), n, k, dx.as<uint16_t>() + (size_t)row0 * k, k, m);
    a.y = dy.as<uint16_t>();
    a.y_row_stride = n;
    CHECK(kx_gemm_run(&a, 0));
    CHECK(cudaDeviceSynchronize());
    std::vector<uint16_t> y((size_t)m * n);
    CHECK(cudaMemcpy(y.data(), dy.p, y.size() * 2, cudaMemcpyDeviceToHost));
    return y;
  };
  const std::vector<uint16_t> full = run(M, 0), again = run(M, 0);
  long diff_repeat = 0, diff_batch = 0;
  for (size_t i = 0; i < full.size(); ++i) diff_repeat += full[i] != again[i];
  for (int m : {1, 2, 7, 9, 16, 17, 33, 64}) /* token r alone or in smaller batches */
    for (int row0 : {0, 3, 66}) {
      const std::vector<uint16_t> part = run(m, row0);
      for (int r = 0; r < m; ++r)
        for (int c = 0; c < n; ++c)
          diff_batch += part[(size_t)r * n + c] != full[(size_t)(row0 + r) * n + c];
    }
  const bool ok = diff_repeat == 0 && diff_batch == 0;
  failures += !ok;
  printf("  N=%d K=%d: repeat run bit-identical: %s; batch-invariant (M=1..64 at offsets 0, 3, "
         "66 vs M=130): %s\n",
         n, k, diff_repeat ? "NO" : "yes", diff_batch ? "NO" : "yes");
}

/* ---- timing --------------------------------------------------------------------------- */
struct GemmSet { /* 8 copies of W [n, k], x [64, k], y [64, n] each */
  int n, k;
  kx_gemm_config cfg;
  std::vector<Dev *> w;
  Dev *x, *y;
  GemmSet(int n_, int k_, int copies, int force_tile = 0, int force_cluster = 0) : n(n_), k(k_) {
    CHECK(kx_gemm_configure(n, k, 0, &cfg));
    force_config(&cfg, n, force_tile, force_cluster);
    std::vector<uint16_t> h((size_t)n * k);
    std::mt19937 rng(n + k);
    std::uniform_int_distribution<int> d(-100, 100);
    for (auto &v : h) v = f2bf(d(rng) * 1e-3f);
    for (int i = 0; i < copies; ++i) {
      w.push_back(new Dev(h.size() * 2));
      CHECK(cudaMemcpy(w.back()->p, h.data(), h.size() * 2, cudaMemcpyHostToDevice));
    }
    x = new Dev((size_t)64 * k * 2);
    y = new Dev((size_t)64 * n * 2 * copies);
    CHECK(cudaMemset(x->p, 0x3C, (size_t)64 * k * 2)); /* bf16 0x3C3C = 0.0115 */
  }
  ~GemmSet() {
    for (auto *p : w) delete p;
    delete x;
    delete y;
  }
  void run(int i, int m, cudaStream_t s, int pdl) {
    kx_gemm_args a = gemm_args(cfg, w[i % w.size()]->as<uint16_t>(), n, k, x->as<uint16_t>(), k, m);
    a.config.pdl = pdl;
    a.y = y->as<uint16_t>() + (size_t)(i % w.size()) * 64 * n;
    a.y_row_stride = n;
    CHECK(kx_gemm_run(&a, s));
  }
};

/* ---- the checks, in order ------------------------------------------------------------ */
static void run_checks(bool quick) {
  printf("correctness:\n");
  uint32_t seed = 1;
  for (auto nk : {std::make_pair(77, 128), std::make_pair(300, 640), std::make_pair(1000, 1024)})
    for (int m : {1, 3, 8, 16, 17, 32, 33, 64, 65, 130})
      for (bool split : {false, true}) check_case(nk.first, nk.second, m, split, seed++);
  for (auto nk : {std::make_pair(1024, 7168), std::make_pair(4096, 7168), std::make_pair(7168, 2048)})
    for (int m : quick ? std::vector<int>{1, 32, 64} : std::vector<int>{1, 9, 32, 64, 65})
      for (bool split : {false, true}) check_case(nk.first, nk.second, m, split, seed++);
  printf("every (tile_n, cluster), forced:\n");
  for (int tile : {64, 128, 256})
    for (int cluster : {1, 2, 4, 8})
      for (int m : quick ? std::vector<int>{1, 33, 64} : std::vector<int>{1, 16, 17, 33, 64})
        check_case(1000, 1024, m, m % 2 == 0, seed++, tile, cluster);
  printf("determinism:\n");
  check_invariance(300, 640);
  check_invariance(4096, 7168);
  check_invariance(7168, 2048); /* tiles of 128 rows, pushed at every M */
  printf("correctness: %s\n", failures ? "SOME FAILED" : "all ok");
}

int main(int argc, char **argv) {
  bool quick = false, check_only = false, time_only = false;
  int rounds = 1, force_tile = 0, force_cluster = 0;
  bool usage = false;
  for (int i = 1; i < argc; ++i) {
    quick = quick || strcmp(argv[i], "--quick") == 0;
    check_only = check_only || strcmp(argv[i], "--check-only") == 0;
    time_only = time_only || strcmp(argv[i], "--time-only") == 0;
    if (strcmp(argv[i], "--rounds") == 0 && i + 1 < argc) rounds = atoi(argv[++i]);
    if (strcmp(argv[i], "--force") == 0 && i + 1 < argc)
      usage = usage || sscanf(argv[++i], "%d,%d", &force_tile, &force_cluster) != 2;
  }
  if (usage || rounds < 1 || (check_only && time_only) || (force_tile != 0 && !time_only) ||
      (force_tile != 0 && force_tile != 64 && force_tile != 128 && force_tile != 256) ||
      (force_tile != 0 && force_cluster != 1 && force_cluster != 2 && force_cluster != 4 && force_cluster != 8)) {
    fprintf(stderr, "usage: %s [--quick] [--check-only | --time-only [--force TILE_N,CLUSTER]] [--rounds R >= 1]\n"
            "  --force times N=4096, K=7168 only, with tiles of TILE_N (64, 128, 256) rows per cluster of\n"
            "  CLUSTER (1, 2, 4, 8) CTAs instead of kx_gemm_configure's choice\n", argv[0]);
    return 2;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("device: %s, %d SMs, sm_%d%d\n", prop.name, prop.multiProcessorCount, prop.major,
         prop.minor);

  printf("configs (kx_gemm_configure):\n");
  for (auto nk : {std::make_pair(1024, 7168), std::make_pair(4096, 7168), std::make_pair(7168, 2048),
                  std::make_pair(300, 640), std::make_pair(77, 128)}) {
    kx_gemm_config c;
    CHECK(kx_gemm_configure(nk.first, nk.second, 0, &c));
    printf("  N=%5d K=%5d: grid %d, cluster %d, tile_n %d, smem %d, threads %d, waves %d, pdl %d\n",
           nk.first, nk.second, c.grid, c.cluster, c.tile_n, c.smem_bytes, c.threads, c.waves, c.pdl);
  }

  if (!time_only) run_checks(quick);
  if (check_only) return failures ? 1 : 0;

  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const double bw = hbm_read_TBps(s);
  printf("HBM read (kx_probe_read, 4 GiB): %.3f TB/s\n", bw);
#ifdef WITH_CUBLAS
  cublasHandle_t hb;
  cublasCreate(&hb);
  cublasSetStream(hb, s);
  Dev cublas_ws((size_t)32 << 20); /* a fixed workspace keeps cuBLAS graph-capturable */
  cublasSetWorkspace(hb, cublas_ws.p, (size_t)32 << 20);
#endif
  const int copies = 8, calls = copies * rounds;
  printf("timing (graph of %d GEMMs over %d weight copies, median of 60 replays, per GEMM):\n", calls,
         copies);
  printf("  %5s %5s %3s | %8s %8s %8s %8s | %7s %8s\n", "N", "K", "M", "us", "us_nopdl", "cublas",
         "floor", "TB/s", "vs cublas");
  const std::vector<std::pair<int, int>> timed =
      force_tile ? std::vector<std::pair<int, int>>{{4096, 7168}}
                 : std::vector<std::pair<int, int>>{{1024, 7168}, {4096, 7168}, {7168, 2048}};
  for (auto nk : timed) {
    GemmSet set(nk.first, nk.second, copies, force_tile, force_cluster);
    printf("  N=%d K=%d: grid %d, cluster %d, tile_n %d%s\n", set.n, set.k, set.cfg.grid, set.cfg.cluster,
           set.cfg.tile_n, force_tile ? " (forced)" : "");
    const double wbytes = 2.0 * nk.first * nk.second;
    for (int m : {1, 4, 8, 16, 32, 64}) {
      const float us = graph_us(s, [&] { for (int i = 0; i < calls; ++i) set.run(i, m, s, 1); }) / calls;
      const float us0 = graph_us(s, [&] { for (int i = 0; i < calls; ++i) set.run(i, m, s, 0); }) / calls;
      float cub = NAN;
#ifdef WITH_CUBLAS
      cub = graph_us(s, [&] {
              const float one = 1.f, zero = 0.f;
              for (int i = 0; i < calls; ++i)
                cublasGemmEx(hb, CUBLAS_OP_T, CUBLAS_OP_N, set.n, m, set.k, &one, set.w[i % copies]->p,
                             CUDA_R_16BF, set.k, set.x->p, CUDA_R_16BF, set.k, &zero,
                             set.y->as<uint16_t>() + (size_t)(i % copies) * 64 * set.n, CUDA_R_16BF,
                             set.n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
            }) / calls;
#endif
      const double floor_us = wbytes / (bw * 1e12) * 1e6;
      printf("  %5d %5d %3d | %8.2f %8.2f %8.2f %8.2f | %7.3f %8.2f\n", nk.first, nk.second, m, us,
             us0, cub, floor_us, wbytes / (us * 1e-6) / 1e12, us / cub);
    }
  }

  if (!force_tile) {
    printf("chain: predecessor WsGemm N=128, K=28672 (16 CTAs, ~8 us, triggers its dependents at once) -> WsGemm "
           "N=4096, K=7168; 8 pairs a graph, weights rotated; the big GEMM's PDL on / off (hidden = the "
           "difference), alone without PDL:\n");
    GemmSet big(4096, 7168, copies), small(128, 28672, copies);
    for (int m : {1, 64}) {
      const float t_small = graph_us(s, [&] { for (int i = 0; i < copies; ++i) small.run(i, m, s, 1); }) / copies;
      const float t_big = graph_us(s, [&] { for (int i = 0; i < copies; ++i) big.run(i, m, s, 0); }) / copies;
      float t_pair[2];
      for (int pdl : {0, 1})
        t_pair[pdl] = graph_us(s, [&] {
                        for (int i = 0; i < copies; ++i) {
                          small.run(i, m, s, 1);
                          big.run(i, m, s, pdl);
                        }
                      }) / copies;
      printf("  M=%2d: small %.2f us, big %.2f us, pair %.2f us, pair without PDL %.2f us, hidden %.2f us, "
             "added %.2f us\n",
             m, t_small, t_big, t_pair[1], t_pair[0], t_pair[0] - t_pair[1], t_pair[1] - t_small);
    }
  }
  CHECK(cudaStreamDestroy(s));
  printf("%s\n", failures ? "FAILED" : "PASSED");
  return failures ? 1 : 0;
}
