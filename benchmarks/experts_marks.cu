/* experts_marks.cu: where one experts launch spends its time, CTA by CTA. A stand-alone
 * program through the C door (kernels/kimi_kernels.h) with the kernel built with -DKX_MARKS
 * (kernels/marks.cuh): lane 0 of each CTA's MMA warp 0 stamps its clock at fixed points and at
 * each of its tiles' steps; the copy and epilogue warps stamp their first copies and the one-token
 * hand-off (hidden words stored, seen). Not part of the library build.
 *
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 --expt-relaxed-constexpr -DKX_MARKS \
 *        -Ikernels benchmarks/experts_marks.cu kernels/experts.cu kernels/pack.cu kernels/probe.cu \
 *        -o /tmp/experts_marks && /tmp/experts_marks [--shape k3-tp8|tp16|E,H,I,K] [--batch B] [--last N]
 *                                      [--inputs cold|hot|near] [--combine] [--routing uniform|same]
 *
 * Weights are random bytes (scales near 1), 8 layers of them rotated in a CUDA graph as in
 * bench_experts.py, every layer with the same ids (B tokens, distinct experts per token), so
 * every launch has the same deal. Prints the time per layer (median of 60 replays; the marks
 * cost a few instructions per chunk, so compare marks builds with marks builds), then the last
 * layer's marks of one more replay: kcycles after each CTA's predecessor wait, the median and
 * the largest over the grid, MMA warp 0's cycles a chunk and its full waits by tile size (the SM
 * clock is the span's kcycles over its globaltimer us: it drops under this kernel), the tile
 * timeline of the N CTAs that exit last, the one-token hand-offs (last hidden word stored ->
 * seen, the time one poll takes), and the 24 CTAs that end the launch with their entry, wait and
 * chunks (which CTAs wait late, and why). With --inputs hot a small kernel rewrites x and the
 * ids (the same values) before each layer, as the router and the layer before would write them,
 * so the layer finds them in L2 (the time per layer then includes that launch); cold (the
 * default, as bench_experts.py) leaves them where the other layers' weights pushed them; near
 * puts them right after the scratch, in pages every call touches (is the start's first load
 * slow for its address translation?). --combine runs the fused combine (random routing weights,
 * out [B, H]); the last CTAs then show when their MMA warps left their tiles and, in one-token
 * launches, when they had the row words to combine. --routing same puts every token on experts
 * 100..100+K-1 (bench_experts.py's `same`: units of 8 tokens, several an expert).
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <map>
#include <random>
#include <vector>

#include "harness.cuh"
#include "probe_work.cuh" /* fill_weights */
#include "kimi_kernels.h"
#include "marks.cuh"
#include "moe_layout.cuh"

#ifndef KX_MARKS
#error "build with -DKX_MARKS (the command in this file's header)"
#endif

using namespace kx; /* marks.cuh's slot names */

/* Rewrites n words in place (the same values), so they sit in L2 as freshly written data. */
__global__ void rewrite_words(uint32_t *words, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    volatile uint32_t *w = words + i;
    *w = *w;
  }
}

static void random_bytes(void *p, size_t n, uint32_t seed, int scales, cudaStream_t stream) {
  fill_weights<<<1024, 256, 0, stream>>>((uint8_t *)p, n, seed, scales);
  CHECK(cudaGetLastError());
}

int main(int argc, char **argv) {
  kx_moe_shape s = {384, 3584, 384, 16};
  const char *name = "k3-tp8";
  int batch = 1, last = 12;
  bool hot_inputs = false, near_inputs = false, combine = false, same = false;
  for (int i = 1; i < argc; i += 2) {
    const char *value = i + 1 < argc ? argv[i + 1] : "";
    if (!strcmp(argv[i], "--combine")) {
      combine = true;
      --i; /* a flag: no value */
    } else if (!strcmp(argv[i], "--shape") && !strcmp(value, "tp16")) {
      s.inter = 192;
      name = "tp16";
    } else if (!strcmp(argv[i], "--shape") &&
               sscanf(value, "%d,%d,%d,%d", &s.experts, &s.hidden, &s.inter, &s.top_k) == 4) {
      name = value; /* E,H,I,K, as race_check.py's --shape */
    } else if (!strcmp(argv[i], "--batch") && atoi(value) > 0) {
      batch = atoi(value);
    } else if (!strcmp(argv[i], "--last") && atoi(value) > 0) {
      last = atoi(value);
    } else if (!strcmp(argv[i], "--routing") && (!strcmp(value, "same") || !strcmp(value, "uniform"))) {
      same = !strcmp(value, "same");
    } else if (!strcmp(argv[i], "--inputs") &&
               (!strcmp(value, "hot") || !strcmp(value, "cold") || !strcmp(value, "near"))) {
      hot_inputs = !strcmp(value, "hot");
      near_inputs = !strcmp(value, "near");
    } else if (strcmp(argv[i], "--shape") || strcmp(value, "k3-tp8")) {
      fprintf(stderr,
              "bad argument: %s %s (--shape k3-tp8|tp16|E,H,I,K, --batch B, --last N, --inputs cold|hot|near, --combine, "
              "--routing uniform|same)\n",
              argv[i], value);
      return 2;
    }
  }
  const int E = s.experts, H = s.hidden, I = s.inter, K = s.top_k, layers = 8;
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  /* 8 packed layers, from one standard-layout set refilled per layer */
  const size_t w13 = (size_t)E * 2 * I * H / 2, s13 = (size_t)E * 2 * I * H / 32;
  const size_t w2 = (size_t)E * H * I / 2, s2 = (size_t)E * H * I / 32;
  Dev dw13(w13), ds13(s13), dw2(w2), ds2(s2);
  std::vector<Dev *> packed;
  for (int l = 0; l < layers; ++l) {
    random_bytes(dw13.p, w13, 11 * l + 1, 0, stream);
    random_bytes(ds13.p, s13, 11 * l + 2, 1, stream);
    random_bytes(dw2.p, w2, 11 * l + 3, 0, stream);
    random_bytes(ds2.p, s2, 11 * l + 4, 1, stream);
    packed.push_back(new Dev(kx_moe_packed_bytes(&s)));
    kx_moe_pack_args pa = {s, dw13.as<uint8_t>(), ds13.as<uint8_t>(), dw2.as<uint8_t>(), ds2.as<uint8_t>(),
                           packed.back()->p};
    CHECK(kx_moe_pack(&pa, stream));
  }

  /* x near 1, ids: K distinct experts per token */
  std::mt19937 rng(batch);
  std::vector<uint16_t> xh((size_t)batch * H);
  for (auto &v : xh) v = (uint16_t)(0x3F80u + rng() % 64); /* bf16 in [1, 1.5) */
  std::vector<int32_t> ids((size_t)batch * K);
  std::vector<float> route_weights((size_t)batch * K);
  for (auto &w : route_weights) w = (float)(rng() % 1024) / 1024.0f;
  std::vector<int> perm(E);
  for (int t = 0; t < batch; ++t) {
    for (int e = 0; e < E; ++e) perm[e] = e;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int j = 0; j < K; ++j) ids[(size_t)t * K + j] = same ? 100 + j : perm[j];
  }
  kx_moe_config cfg;
  CHECK(kx_moe_configure(&s, 0, &cfg));
  const size_t scratch_bytes = kx_moe_scratch_bytes(&s, &cfg);
  /* --inputs near: x and the ids right after the scratch, in the pages every call touches */
  const size_t x_bytes = xh.size() * 2, ids_bytes = ids.size() * 4, near_at = (scratch_bytes + 255) / 256 * 256;
  const size_t ids_near = near_at + (x_bytes + 255) / 256 * 256;
  Dev scratch(near_inputs ? ids_near + ids_bytes : scratch_bytes), dx(x_bytes), dids(ids_bytes),
      dweights(route_weights.size() * 4), dout((size_t)batch * K * H * 2), fault(8);
  uint16_t *x_at = near_inputs ? (uint16_t *)(scratch.as<uint8_t>() + near_at) : dx.as<uint16_t>();
  int32_t *ids_at = near_inputs ? (int32_t *)(scratch.as<uint8_t>() + ids_near) : dids.as<int32_t>();
  /* everything on `stream`: a non-blocking stream does not wait for the legacy default one */
  CHECK(cudaMemsetAsync(scratch.p, 0, scratch_bytes, stream));
  CHECK(cudaMemsetAsync(fault.p, 0, 8, stream));
  CHECK(cudaMemcpyAsync(x_at, xh.data(), x_bytes, cudaMemcpyHostToDevice, stream));
  CHECK(cudaMemcpyAsync(ids_at, ids.data(), ids_bytes, cudaMemcpyHostToDevice, stream));
  CHECK(cudaMemcpyAsync(dweights.p, route_weights.data(), route_weights.size() * 4, cudaMemcpyHostToDevice, stream));
  CHECK(cudaStreamSynchronize(stream));
  std::vector<kx_moe_args> args(layers);
  for (int l = 0; l < layers; ++l) {
    kx_moe_args &a = args[l];
    memset(&a, 0, sizeof a);
    a.shape = s;
    a.config = cfg;
    a.packed = packed[l]->p;
    a.scratch = scratch.p;
    a.fault = fault.as<unsigned long long>();
    a.x = x_at;
    a.x_row_stride = H;
    a.ids = ids_at;
    a.ids_row_stride = K;
    a.out = dout.as<uint16_t>();
    a.out_row_stride = H;
    if (combine) { /* out [B, H] */
      a.route_weights = dweights.as<float>();
      a.weights_row_stride = K;
    }
    a.batch = batch;
    /* bench_experts.py's caps (the library's defaults): uncapped, these random weights' FC1 sums
     * overflow expf(-z) and send SiTU's division down its slow path, which real layers do not take */
    a.beta = 4.0f;
    a.linear_beta = 25.0f;
  }
  const auto layers_body = [&] {
    for (int l = 0; l < layers; ++l) {
      if (hot_inputs) {
        rewrite_words<<<1, 256, 0, stream>>>((uint32_t *)x_at, (int)(xh.size() / 2));
        rewrite_words<<<1, 256, 0, stream>>>((uint32_t *)ids_at, (int)ids.size());
        CHECK(cudaGetLastError());
      }
      CHECK(kx_moe_run(&args[l], stream));
    }
  };
  const float us = graph_us(stream, layers_body) / layers;

  /* one more replay, its last layer's marks */
  const cudaGraphExec_t ge = capture_graph(stream, layers_body);
  CHECK(kx_marks_clear(stream));
  CHECK(cudaGraphLaunch(ge, stream));
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaGraphExecDestroy(ge));
  const int grid = cfg.grid;
  std::vector<unsigned long long> m((size_t)grid * kMarkSlots), tm((size_t)kMarkMaxTiles * kMarksPerTile);
  CHECK(kx_marks_read(m.data(), grid, tm.data(), kMarkMaxTiles));
  /* kcycles from CTA c's predecessor wait to its stamp in slot (-1: none). Under programmatic
   * dependent launch a CTA enters as an SM frees, often long before the predecessor ends, so
   * its work is timed from the wait. */
  const auto at = [&](int c, int slot) {
    const unsigned long long *row = &m[(size_t)c * kMarkSlots];
    return row[slot] ? (double)(long long)(row[slot] - row[kMarkWaited]) / 1000.0 : -1.0;
  };
  const auto ns = [&](int c, int slot) { return m[(size_t)c * kMarkSlots + slot]; };
  unsigned long long waited = ~0ull, done = 0;
  for (int c = 0; c < grid; ++c) {
    waited = std::min(waited, ns(c, kMarkWaitedNs));
    done = std::max(done, ns(c, kMarkExitNs));
  }
  /* each CTA's tiles in the order it took them (the tile deal decides which) */
  std::vector<std::vector<int>> tiles_of(grid);
  for (int index = 0; index < kMarkMaxTiles; ++index) {
    const unsigned long long cta = tm[(size_t)index * kMarksPerTile + kMarkTileCta];
    if (cta >= 1 && cta <= (unsigned long long)grid) tiles_of[cta - 1].push_back(index);
  }
  for (auto &list : tiles_of)
    std::sort(list.begin(), list.end(), [&](int a, int b) {
      return tm[(size_t)a * kMarksPerTile + kMarkTileEnter] < tm[(size_t)b * kMarksPerTile + kMarkTileEnter];
    });
  /* a %globaltimer tile mark in us after the grid's first predecessor wait (-1: none) */
  const auto tile_ns = [&](int index, int k) {
    const unsigned long long v = tm[(size_t)index * kMarksPerTile + k];
    return v ? (double)(long long)(v - waited) / 1000.0 : -1.0;
  };
  /* the units: ceil(tokens / 8) of each distinct expert (one token: its K), an id's count being its expert's tokens
   * (a token's K experts are distinct); each unit's last FC1 tile to store its hidden words (one token) or its h
   * (several) */
  const PhaseShape fc1 = fc1_shape(E, H, I), fc2 = fc2_shape(E, H, I);
  std::map<int32_t, int> tokens_of;
  for (int32_t id : ids) ++tokens_of[id];
  int units = 0;
  for (const auto &e : tokens_of) units += (e.second + 7) / 8;
  const int fc1_tiles = units * fc1.tiles;
  std::vector<double> last_stored(units, -1.0);
  for (int index = 0; index < fc1_tiles; ++index)
    last_stored[index / fc1.tiles] = std::max(last_stored[index / fc1.tiles], tile_ns(index, kMarkTileStored));
  /* mark k of CTA c's n-th tile (-1: none) */
  const auto tile_at = [&](int c, int n, int k) {
    if (n >= (int)tiles_of[c].size()) return -1.0;
    const unsigned long long v = tm[(size_t)tiles_of[c][n] * kMarksPerTile + k];
    return v ? (double)(long long)(v - m[(size_t)c * kMarkSlots + kMarkWaited]) / 1000.0 : -1.0;
  };

  printf("%s B=%d, %s inputs, %s: %.2f us per layer (graph of %d rotated layers, median of 60), grid %d\n", name,
         batch, hot_inputs ? "hot" : near_inputs ? "near" : "cold", combine ? "combined" : "rows", us, layers, grid);
  printf("the first CTA past the predecessor wait to the last exit: %.2f us (globaltimer)\n", (done - waited) / 1000.0);
  const char *names[] = {"entry (< 0)",    "barriers (< 0)", "warmed (< 0)",   "prologue (< 0)", "router tables",
                         "router synced",  "weights enter",  "weights looked", "first copy",     "routed",
                         "nan rows done",  "fc1 planned",    "first full",     "fc1 done",       "fc2 planned",
                         "first fc2 copy", "fc2 act stage",  "fc2 act done",   "exit",           "act 0 stage",
                         "act 1 stage",    "route done",     "x counted",      "past join",      "x seen"};
  const int slots[] = {kMarkEntry,        kMarkBarriersInit, kMarkWarmed,        kMarkPrologue,    kMarkRouterTables,
                       kMarkRouterSynced, kMarkWeightsEnter, kMarkWeightsLooked, kMarkFirstCopy,   kMarkRouted,
                       kMarkNanDone,      kMarkFc1Planned,   kMarkFirstFull,     kMarkFc1Done,     kMarkFc2Planned,
                       kMarkFirstFc2Copy, kMarkFc2ActStage,  kMarkFc2ActDone,    kMarkExit,        kMarkActStage,
                       kMarkActStage1,    kMarkRouteDone,    kMarkXCounted,      kMarkPastJoin,    kMarkXSeen};
  const int n_fixed = (int)(sizeof slots / sizeof slots[0]);
  printf("kcycles after each CTA's predecessor wait, median / max over the grid (-1: not stamped):\n");
  for (int k = 0; k < n_fixed; ++k) {
    std::vector<double> v;
    for (int c = 0; c < grid; ++c) v.push_back(at(c, slots[k]));
    printf("  %-14s %7.2f / %7.2f\n", names[k], median(v), percentile(v, 1.0));
  }

  /* MMA warp 0's pace: per tile, its chunks' time from before the first stage wait to the sums, and the part of it
   * in full waits; by the tile's chunk count (k3-tp8: FC1 7, FC2 3), medians over the launch's tiles */
  std::vector<int> chunk_counts;
  for (int index = 0; index < kMarkMaxTiles; ++index) {
    const unsigned long long n = tm[(size_t)index * kMarksPerTile + kMarkTileChunks];
    if (n > 0 && std::find(chunk_counts.begin(), chunk_counts.end(), (int)n) == chunk_counts.end())
      chunk_counts.push_back((int)n);
  }
  std::sort(chunk_counts.begin(), chunk_counts.end());
  for (const int n : chunk_counts) {
    std::vector<double> per_chunk, waits;
    for (int index = 0; index < kMarkMaxTiles; ++index) {
      const unsigned long long *t = &tm[(size_t)index * kMarksPerTile];
      if ((int)t[kMarkTileChunks] != n || !t[kMarkTileStart] || !t[kMarkTileData] || !t[kMarkTileSums]) continue;
      per_chunk.push_back((double)(long long)(t[kMarkTileSums] - t[kMarkTileStart]) / n);
      /* the first chunk's wait is the one before kMarkTileData (its wait in the loop then returns at once) */
      waits.push_back((double)(t[kMarkTileWaits] + (t[kMarkTileData] - t[kMarkTileStart])) / n);
    }
    printf("MMA warp 0, tiles of %d chunks (%zu): %.0f cycles a chunk from the tile's start to its sums, %.0f of them "
           "in full waits (medians)\n",
           n, per_chunk.size(), median(per_chunk), median(waits));
  }

  /* the CTAs that exit last (globaltimer) */
  std::vector<int> order(grid);
  for (int c = 0; c < grid; ++c) order[c] = c;
  std::sort(order.begin(), order.end(), [&](int a, int b) { return ns(a, kMarkExitNs) > ns(b, kMarkExitNs); });
  printf("the %d CTAs that exit last: wait (us after the first), router tables, router synced, weights enter, first "
         "copy, routed, nan rows done, fc1 planned, first full\n"
         "  | per tile: index:[enter, start (looked up), first stage full, chunks' MMAs done, handed off (MMA warp 0)\n"
         "  |   | every MMA warp's sums parked, the epilogue's stores done (its epilogue warp)\n"
         "  |   | one-token FC1: its hidden words stored | FC2: its unit's last FC1 tile stored, each chunk's\n"
         "  |     polling begun - hidden words seen / polls (these in us after the first CTA's wait, globaltimer)]\n"
         "  | fc1 done, fc2 planned, first fc2 copy, its activations' stage, their copy, exit (kcycles after the CTA's "
         "wait)\n",
         last);
  for (int i = 0; i < last && i < grid; ++i) {
    const int c = order[i];
    printf("  cta %3d: %5.2f %5.2f %5.2f %5.2f %5.2f %5.2f %5.2f %5.2f %5.2f\n   |", c,
           (ns(c, kMarkWaitedNs) - waited) / 1000.0, at(c, kMarkRouterTables), at(c, kMarkRouterSynced),
           at(c, kMarkWeightsEnter), at(c, kMarkFirstCopy), at(c, kMarkRouted), at(c, kMarkNanDone),
           at(c, kMarkFc1Planned), at(c, kMarkFirstFull));
    for (int n = 0; tile_at(c, n, kMarkTileEnter) >= 0; ++n) {
      const int index = tiles_of[c][n];
      printf(" %d:[%.2f %.2f %.2f %.2f %.2f", index, tile_at(c, n, kMarkTileEnter), tile_at(c, n, kMarkTileStart),
             tile_at(c, n, kMarkTileData), tile_at(c, n, kMarkTileSums), tile_at(c, n, kMarkTileDone));
      if (tile_at(c, n, kMarkTileParked) >= 0 && tile_at(c, n, kMarkTileSummed) >= 0)
        printf(" | parked %.2f summed %.2f activated %.2f stored %.2f", tile_at(c, n, kMarkTileParked),
               tile_at(c, n, kMarkTileSummed), tile_at(c, n, kMarkTileActivated), tile_at(c, n, kMarkTileEpilogue));
      else if (tile_at(c, n, kMarkTileParked) >= 0)
        printf(" | parked %.2f stored %.2f", tile_at(c, n, kMarkTileParked), tile_at(c, n, kMarkTileEpilogue));
      if (tile_ns(index, kMarkTileStored) >= 0) printf(" | stored %.2f", tile_ns(index, kMarkTileStored));
      if (tile_ns(index, kMarkTileReleased) >= 0) printf(" released %.2f", tile_ns(index, kMarkTileReleased));
      if (tile_ns(index, kMarkTileReady) >= 0) printf(" | ready %.2f", tile_ns(index, kMarkTileReady));
      if (index >= fc1_tiles && last_stored[(index - fc1_tiles) / fc2.tiles] > 0)
        printf(" | unit's last stored %.2f", last_stored[(index - fc1_tiles) / fc2.tiles]);
      for (int k = 0; k < kMarkSeenChunks && tile_ns(index, kMarkTileSeen + k) >= 0; ++k)
        printf("%s%.2f-%.2f/%llu", k ? " " : ", polled-seen/polls ", tile_ns(index, kMarkTilePolled + k),
               tile_ns(index, kMarkTileSeen + k), tm[(size_t)index * kMarksPerTile + kMarkTilePolls + k]);
      printf("]");
    }
    printf("\n   | %.2f %.2f %.2f %.2f %.2f %.2f\n", at(c, kMarkFc1Done), at(c, kMarkFc2Planned),
           at(c, kMarkFirstFc2Copy), at(c, kMarkFc2ActStage), at(c, kMarkFc2ActDone), at(c, kMarkExit));
  }
  const auto quartiles = [](const std::vector<double> &v, const char *what) {
    if (v.empty()) return;
    printf("  %s: %zu, quartiles %.2f / %.2f / %.2f, max %.2f\n", what, v.size(), percentile(v, 0.25), median(v),
           percentile(v, 0.75), percentile(v, 1.0));
  };
  if (batch > 1) { /* several tokens: a unit's hidden rows released by its last FC1 tile's epilogue warp */
    std::vector<double> chain, ready_after, first_wait;
    for (int u = 0; u < units; ++u) {
      double released = -1.0;
      for (int f = 0; f < fc1.tiles; ++f) released = std::max(released, tile_ns(u * fc1.tiles + f, kMarkTileReleased));
      if (released >= 0 && last_stored[u] >= 0) chain.push_back(released - last_stored[u]);
      for (int f = 0; f < fc2.tiles; ++f) {
        const int index = fc1_tiles + u * fc2.tiles + f;
        if (index >= kMarkMaxTiles) break;
        const unsigned long long *t = &tm[(size_t)index * kMarksPerTile];
        if (released >= 0 && tile_ns(index, kMarkTileReady) >= 0)
          ready_after.push_back(tile_ns(index, kMarkTileReady) - released);
        if (t[kMarkTileStart] && t[kMarkTileData]) first_wait.push_back((double)(t[kMarkTileData] - t[kMarkTileStart]) / 1000.0);
      }
    }
    printf("hand-offs of several tokens:\n");
    quartiles(chain, "a unit's last FC1 tile stored -> its rows released (us)");
    quartiles(ready_after, "FC2 tiles: their unit released -> their activation warp knows it (us)");
    quartiles(first_wait, "FC2 tiles: MMA warp 0's wait for the first stage (kcycles)");
  }
  /* one-token hand-offs: for each FC2 chunk whose activation warp polled before its words were all
   * stored, from the last store to the poll that saw it; and the time a poll takes when it repeats */
  if (batch == 1) {
    std::vector<double> handoff, per_poll;
    for (int index = fc1_tiles; index < fc1_tiles + units * fc2.tiles && index < kMarkMaxTiles; ++index) {
      const int unit = (index - fc1_tiles) / fc2.tiles;
      for (int c = 0; c < kMarkSeenChunks && c < fc2.chunks(); ++c) {
        const double polled = tile_ns(index, kMarkTilePolled + c), seen = tile_ns(index, kMarkTileSeen + c);
        const unsigned long long polls = tm[(size_t)index * kMarksPerTile + kMarkTilePolls + c];
        if (polled < 0 || seen < 0) continue;
        double stored = -1.0; /* FC1 tile f is FC2's k-block f */
        for (int f = c * fc2.chunk_kb; f < (c + 1) * fc2.chunk_kb && f < fc1.tiles; ++f)
          stored = std::max(stored, tile_ns(unit * fc1.tiles + f, kMarkTileStored));
        if (stored > polled) handoff.push_back(seen - stored);
        if (polls > 1) per_poll.push_back((seen - polled) / (double)polls);
      }
    }
    printf("one-token hand-offs (FC2 chunks):\n");
    quartiles(handoff, "polled before the words were stored; last store -> seen (us)");
    quartiles(per_poll, "polled more than once; time per poll (us)");
  }

  /* the launch's end, CTA by CTA: which CTAs end it, how late they entered and waited, their chunks */
  const auto chunks_of = [&](int c) {
    int n = 0;
    for (int index : tiles_of[c]) n += index < fc1_tiles ? fc1.chunks() : fc2.chunks();
    return n;
  };
  int late_waits = 0, entered_after = 0;
  for (int c = 0; c < grid; ++c) {
    late_waits += ns(c, kMarkWaitedNs) - waited > 250;
    entered_after += ns(c, kMarkEntryNs) > waited;
  }
  printf("CTAs past their wait > 0.25 us after the first: %d; entered after the first wait: %d\n", late_waits,
         entered_after);
  printf("the 24 CTAs that exit last (us after the first wait: entry, wait, tiles done, the combine's first poll back,"
         " its words seen (polls), summed, exit; chunks):\n");
  const auto ns_after = [&](int c, int slot) { return ns(c, slot) ? (ns(c, slot) - (double)waited) / 1000.0 : -1.0; };
  for (int i = 0; i < 24 && i < grid; ++i) {
    const int c = order[i];
    printf("  cta %3d: %6.2f %5.2f %6.2f %6.2f %6.2f (%llu) %6.2f %6.2f  %2d%s", c, ns_after(c, kMarkEntryNs),
           ns_after(c, kMarkWaitedNs), ns_after(c, kMarkTilesDoneNs), ns_after(c, kMarkCombinePolledNs),
           ns_after(c, kMarkCombineSeenNs), ns(c, kMarkCombinePolls), ns_after(c, kMarkCombineSummedNs),
           ns_after(c, kMarkExitNs), chunks_of(c), i % 2 == 1 ? "\n" : " |");
  }
  /* the combine's start on MMA warp 0 (clock64): tiles done -> its first poll's loads issued (the item's
   * code, its lookups) -> back */
  std::vector<double> to_issue, to_back;
  for (int c = 0; c < grid; ++c) {
    const unsigned long long tiles_done = ns(c, kMarkTilesDone), issued = ns(c, kMarkCombineIssued);
    const unsigned long long back = ns(c, kMarkCombineBack);
    if (!tiles_done || !issued || !back) continue;
    to_issue.push_back((double)(long long)(issued - tiles_done));
    to_back.push_back((double)(long long)(back - issued));
  }
  quartiles(to_issue, "the combine: tiles done -> first poll issued (cycles)");
  quartiles(to_back, "the combine: first poll issued -> back (cycles)");
  /* which CTAs leave their tiles first: by the CTA's FC1 and FC2 tiles, when their tiles were done */
  printf("tiles done (us after the first wait) by the CTA's FC1 / FC2 tiles: CTAs, first CTA, min / median / max\n");
  std::map<std::pair<int, int>, std::vector<std::pair<double, int>>> by_tiles;
  for (int c = 0; c < grid; ++c) {
    int n1 = 0;
    for (int index : tiles_of[c]) n1 += index < fc1_tiles;
    by_tiles[{n1, (int)tiles_of[c].size() - n1}].push_back({ns_after(c, kMarkTilesDoneNs), c});
  }
  for (auto &[tiles, ends] : by_tiles) {
    std::sort(ends.begin(), ends.end());
    int first = grid;
    for (auto &e : ends) first = std::min(first, e.second);
    printf("  %d / %d: %3zu CTAs from %3d, %6.2f / %6.2f / %6.2f\n", tiles.first, tiles.second, ends.size(), first,
           ends.front().first, ends[ends.size() / 2].first, ends.back().first);
  }
  for (Dev *d : packed) delete d;
  return 0;
}
