/* ws_gemm.cu: the skinny GEMM in front of the MoE ("WsGemm", SPEC 4), bf16 on sm_90a.
 *
 * Math
 *   y[m, n] = sum_k x[m, k] * W[n, k]        x bf16 [M, K], W bf16 [N, K], fp32 accumulation.
 *   Plain epilogue: y as bf16 [M, N]. Split epilogue: columns n < valid as fp32 to logits[m, n],
 *   columns n >= split as bf16 to latent[m, n - split]; columns in [valid, split) are dropped.
 *   -0.0 is never written: it becomes +0.0 (for bf16 after rounding, so tiny negatives too).
 *
 * Data layout and shape limits
 *   W row-major [N, K] contiguous, 16-byte aligned; x row-major with a row stride that is a
 *   multiple of 8 elements (16 bytes) and >= K, 16-byte aligned; outputs any row stride, column
 *   stride 1. K % 64 == 0, K >= 64 * cluster (kx_gemm_configure guarantees the latter); any N >= 1;
 *   any M: one launch covers up to 64 rows of x and kx_gemm_run launches ceil(M / 64) times (each
 *   launch re-streams W, so M > 64 costs one weight pass per 64 rows).
 *
 * Why it is shaped this way
 *   At M <= 64 this GEMM is a weight stream: N=4096, K=7168 reads 58.7 MB of weights for at most
 *   3.8 GFLOP, so its time is weight bytes / HBM bandwidth plus whatever does not overlap that
 *   stream: the launch, the pipeline fill, the split-K reduction and the epilogue.
 *   - Grid. One CTA per SM (it takes all 227 KB of shared memory), clusters of C CTAs. A cluster
 *     owns a tile of R = tile_n rows of W (64, 128 or 256); its C CTAs split K into C contiguous
 *     ranges of 64-wide "units". kx_gemm_configure picks (R, C) deterministically: fewest waves
 *     (each wave pays the pipeline fill and the reduction again), then fewest weight bytes per CTA
 *     (= most SMs streaming), then R = 128 before 256 before 64 (x is re-read once per tile,
 *     partial sums grow with R), then the smaller cluster (cheaper reduction).
 *     N=4096, K=7168 -> R=128, C=4: 32 clusters x 4 = 128 CTAs of 128 rows x 1792 k (458 KB).
 *   - Pipeline. One producer lane issues TMA tensor copies (cp.async.bulk.tensor, 128B swizzle) of
 *     one unit per stage: W[R rows x 64 k] and x[8G tokens x 64 k] (rows past N or M are zero-filled
 *     by the TMA), into a ring of stages guarded by full/empty mbarriers; 8 consumer warps run the
 *     MMAs. One 16 KB copy per 16 KB of weights keeps the producer's work negligible.
 *   - Weight-stationary + programmatic dependent launch. The kernel triggers its dependents at once
 *     (griddepcontrol.launch_dependents), and the producer fills EVERY ring stage with weights
 *     BEFORE griddepcontrol.wait: at R = 128, 128 KB (M > 32) to 192 KB (M <= 16) of a 458 KB
 *     slice is requested while the predecessor still runs (at N=1024, K=7168: 96 of 112 KB).
 *     Only x (which the predecessor may write) and the outputs wait. The rest of the slice
 *     streams through the ring afterwards; registers hold no weights across the wait (the
 *     ring already covers what a CTA can hold).
 *   - MMA. mma.sync m16n8k16 bf16 "swap AB": 16 weight rows on the MMA's M side, 8 tokens on its
 *     N side. Fragments come from ldmatrix.x4 straight out of the TMA's 128B-swizzled tiles: each
 *     8-row matrix reads 8 distinct 16-byte bank groups (no conflicts) and lands in the exact
 *     register quad the MMA takes (a 16-byte ld.shared with a K permutation would need 4 register
 *     moves per MMA to build that quad).
 *   - Warps. Consumer warp = (k-group kg, row group rg, token half tg): it owns 64 weight rows
 *     (4 strips) x half of the token groups and consumes every KG-th unit (KG = 4 / (R / 64)).
 *     Splitting tokens (not K) between two warps halves the partial sums the epilogue must reduce.
 *   - Reduction, deterministic. k-groups add up in shared memory in the order kg = 0, 1, ..; then
 *     cluster rank c sums rows [c R/C, (c+1) R/C) of all C CTAs' partials through distributed
 *     shared memory in rank order 0..C-1 and writes the epilogue. All token groups share every
 *     weight load, so they all finish the K loop together; the reduction is one short phase after
 *     it (reduce-scatter: every CTA reads R/C rows, a quarter of its tile at C = 4).
 *   - Batch invariance. Tokens always sit in the same MMA column (token i -> group i / 8 of its
 *     64-row block) and the summation order depends only on (N, K, config), never on M, timing or
 *     the token's neighbours: a token's output is bit-identical at every batch size. For that
 *     reason M <= 16 also runs two token groups (the second partly or wholly empty), which costs
 *     nothing that shows: at M <= 16 the MMAs are a small fraction of the issue slots.
 *
 * Sections: constants / layout helpers (host+device) / device primitives / the kernel (setup,
 * producer, consumers, reduction, epilogue) / host side (tensor maps, configure, run).
 */
#include <cuda.h> /* CUtensorMap and its enums; the driver entry point is fetched at run time */
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kimi_kernels.h"
#include "pipeline.cuh" /* mbarriers, L2 policy, PDL, named barriers: shared with experts.cu */

namespace kx_gemm {

using kx::allow_dependents;
using kx::fence_barrier_init;
using kx::l2_evict_first_policy;
using kx::mbar_arrive;
using kx::mbar_arrive_expect_tx;
using kx::mbar_init;
using kx::mbar_wait;
using kx::named_barrier;
using kx::smem_addr;
using kx::wait_for_predecessor;

/* ===================================================================================== */
/* Constants                                                                              */
/* ===================================================================================== */

constexpr int kUnitK = 64;                 /* K elements per pipeline stage ("unit") */
constexpr int kUnitRowBytes = kUnitK * 2;  /* one unit row of bf16 = one 128-byte swizzle span */
constexpr int kSwizzleAtomBytes = 1024;    /* 128B swizzle repeats every 8 rows x 128 bytes */
constexpr int kConsumerWarps = 8;
constexpr int kProducerWarp = kConsumerWarps; /* the last warp; only its lane 0 issues copies */
constexpr int kThreads = (kConsumerWarps + 1) * 32;
constexpr int kStrips = 4;                 /* 16-row MMA strips per consumer warp */
constexpr int kWarpRows = 16 * kStrips;    /* weight rows per consumer warp */
constexpr int kTokenHalves = 2;            /* consumer warps that share one row group, by tokens */
constexpr int kMaxM = 64;                  /* rows of x per launch */
constexpr int kMaxGroups = kMaxM / 8;      /* 8-token MMA groups per launch */
constexpr int kMaxStages = 32;
constexpr int kMaxCluster = 8;             /* portable cluster size limit */
constexpr int kPartialPad = 4;             /* floats of padding per token row of a partial tile */
constexpr int kConsumerBarrier = 1;        /* named barrier id for the consumer warps (0 = syncthreads) */

static_assert(kUnitRowBytes == 128, "a unit row must be exactly one 128-byte swizzle span");
static_assert(kWarpRows % 16 == 0, "a warp's rows are whole 16-row strips, so each ldmatrix "
                                    "8-row matrix starts at a multiple of 8 (swizzle phase 0)");
static_assert(kConsumerWarps % kTokenHalves == 0, "consumer warps split evenly into token halves");
static_assert(kMaxGroups % kTokenHalves == 0, "token groups split evenly into halves");
static_assert((kWarpRows * kUnitRowBytes) % kSwizzleAtomBytes == 0 &&
                  (8 * kUnitRowBytes) % kSwizzleAtomBytes == 0,
              "the W and x parts of a stage must each start on a 1024-byte swizzle atom");
static_assert(kPartialPad % 4 == 0 && kWarpRows % 4 == 0,
              "partial rows must keep 16-byte alignment for the epilogue's float4 reads");
static_assert((2 * kPartialPad) % 32 == 8,
              "2 * (tile_n + pad) % 32 == 8 makes the fragment stores of lanes (g, q) at row g, "
              "token 2q hit 32 distinct banks (tile_n is a multiple of 16)");
static_assert(kThreads <= 1024, "one CTA");

/* ===================================================================================== */
/* Layout helpers, shared by the kernel and the host (one place for the arithmetic)       */
/* ===================================================================================== */

/* Byte offset of 16-byte chunk `chunk` (0..7) of row `row` inside a TMA box written with
 * CU_TENSOR_MAP_SWIZZLE_128B into a 1024-byte aligned buffer whose rows are 128 bytes. */
__host__ __device__ constexpr uint32_t swizzle128(uint32_t row, uint32_t chunk) {
  return row * kUnitRowBytes + ((chunk ^ (row & 7u)) << 4);
}

/* ldmatrix.x4 row addresses. Lane l names row (l & 7) of 8x8 matrix l >> 3.
 * A (weights, m16n8k16 row-major 16 x 16): matrices {rows 0-7, rows 8-15} x {k 0-7, k 8-15},
 * in the order of the fragment registers a0..a3; for MMA k-step j (16j .. 16j + 15 of the unit)
 * lane l reads row (l & 7) + 8 ((l >> 3) & 1), chunk 2j + (l >> 4).
 * B (tokens, 16 x 8 "col", stored token-major): for the MMA pair (2p, 2p + 1) lane l reads token
 * (l & 7), chunk 4p + (l >> 3): registers {b0, b1} of MMA 2p, then of MMA 2p + 1.
 * Offsets below are for j = 0 / p = 0 relative to a row that is a multiple of 8 (so the swizzle
 * phase is (l & 7)); chunk 2j + x = (2j) ^ x and 4p + x = (4p) ^ x for x < 2 resp. x < 4, so
 * step j is `offset ^ (j << 5)` and pair p is `offset ^ (p << 6)`: each 8-row matrix reads 8
 * distinct 16-byte bank groups (the swizzle), no bank conflicts, no shuffles. */
__host__ __device__ constexpr uint32_t a_lane_offset(uint32_t lane) {
  return swizzle128((lane & 7u) + 8u * ((lane >> 3) & 1u), lane >> 4);
}
__host__ __device__ constexpr uint32_t b_lane_offset(uint32_t lane) {
  return swizzle128(lane & 7u, lane >> 3);
}
constexpr uint32_t kStepXor = 1u << 5; /* A: k-step j of a unit -> address ^ (j * kStepXor) */
constexpr uint32_t kPairXor = 1u << 6; /* B: MMA pair p of a unit -> address ^ (p * kPairXor) */

/* Shared-memory plan of one launch: the ring of stages, its barriers and, after the K loop,
 * the partial-sum slices (which reuse the ring). */
struct SmemPlan {
  int32_t w_bytes;     /* W part of a stage: tile_n rows x 128 bytes */
  int32_t x_bytes;     /* x part of a stage: 8 * groups token rows x 128 bytes */
  int32_t stage_bytes;
  int32_t stages;      /* ring depth, a multiple of k_groups */
  int32_t k_groups;    /* consumer warps split K this many ways inside a CTA */
  int32_t row_groups;  /* tile_n / 64 */
  int32_t slice_bytes; /* one k-group's partial sums: fp32 [8 * groups][tile_n + pad] */
};

__host__ __device__ inline SmemPlan plan_smem(int32_t smem_bytes, int32_t tile_n, int32_t groups) {
  SmemPlan p;
  p.w_bytes = tile_n * kUnitRowBytes;
  p.x_bytes = 8 * groups * kUnitRowBytes;
  p.stage_bytes = p.w_bytes + p.x_bytes;
  p.row_groups = tile_n / kWarpRows;
  p.k_groups = p.row_groups > 0 ? kConsumerWarps / (p.row_groups * kTokenHalves) : 0;
  /* two 8-byte mbarriers per stage; kSwizzleAtomBytes of slack to align the ring. The depth is
   * rounded down to a multiple of k_groups so that slot i only ever holds units of k-group
   * i % k_groups: a warp's previous fill of a slot is one it waited on itself, so the parity
   * wait can never mistake a fill two phases back for the one it wants. */
  int32_t s = (smem_bytes - kSwizzleAtomBytes) / (p.stage_bytes + 16);
  s = s < kMaxStages ? s : kMaxStages;
  p.stages = p.k_groups > 0 ? s / p.k_groups * p.k_groups : 0;
  p.slice_bytes = 8 * groups * (tile_n + kPartialPad) * 4;
  return p;
}

/* Every k-group needs a slot to read and one in flight, and the partial slices must fit in the
 * ring they reuse. */
__host__ __device__ inline bool plan_fits(const SmemPlan &p) {
  return p.k_groups >= 1 && p.stages >= 2 * p.k_groups &&
         (int64_t)p.k_groups * p.slice_bytes <= (int64_t)p.stages * p.stage_bytes;
}

/* Kernel parameters that are not tensor maps. */
struct Params {
  int32_t n, k, m;          /* m: rows of x in this launch, 1..64 */
  int32_t tile_n, cluster, smem_bytes;
  int32_t split_epilogue, valid, split;
  uint16_t *y;
  int64_t y_row_stride;
  float *logits;
  int64_t logits_row_stride;
  uint16_t *latent;
  int64_t latent_row_stride;
};

/* ===================================================================================== */
/* Device primitives (PTX)                                                                */
/* ===================================================================================== */

__device__ __forceinline__ void prefetch_tensormap(const CUtensorMap *map) {
  asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

/* 2D tensor copy global -> this CTA's shared memory; completion counted in bytes on `bar`. */
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int32_t c_inner,
                                            int32_t c_outer, uint32_t bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c_inner), "r"(c_outer), "r"(bar), "l"(policy)
      : "memory");
}

__device__ __forceinline__ void tma_load_2d(uint32_t dst, const CUtensorMap *map, int32_t c_inner,
                                            int32_t c_outer, uint32_t bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3}], [%4];" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c_inner), "r"(c_outer), "r"(bar)
      : "memory");
}

__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

/* All threads of all CTAs of the cluster; release/acquire orders the shared-memory partials. */
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&v)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3])
               : "r"(addr));
}

__device__ __forceinline__ void sts_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

__device__ __forceinline__ float lds_f32(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}

/* 16 bytes of CTA `rank`'s shared memory at the address `addr` has in this CTA. */
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr, uint32_t rank) {
  uint32_t remote;
  float4 v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(remote)
               : "memory");
  return v;
}

__device__ __forceinline__ float4 lds_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

/* d += A[16 x 16] * B[16 x 8], bf16 in, fp32 accumulate (A row-major, B column-major fragments) */
__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2,
                                               uint32_t a3, uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

/* bf16 bits of v rounded to nearest even, with -0.0 (also from rounding) turned into +0.0 */
__device__ __forceinline__ uint16_t bf16_bits_no_negzero(float v) {
  const uint16_t b = __bfloat16_as_ushort(__float2bfloat16_rn(v));
  return b == 0x8000u ? (uint16_t)0 : b;
}

__device__ __forceinline__ float f32_no_negzero(float v) {
  return __float_as_uint(v) == 0x80000000u ? 0.0f : v;
}

/* ===================================================================================== */
/* The kernel                                                                             */
/* ===================================================================================== */

/* One 64-wide unit of one consumer warp: 4 k-steps x 4 strips x kGW token groups of MMAs.
 * `a_addr` / `b_addr`: this lane's ldmatrix address for k-step 0 / pair 0 of strip 0 / group 0
 * in the W / x part of the stage. Strips are 16 rows (2 KB) apart, groups 8 tokens (1 KB);
 * neither moves the swizzle bits (4..6) that the k-step / pair XOR flips. */
template <int kGW>
__device__ __forceinline__ void mma_unit(float (&acc)[kStrips][kGW][4], uint32_t a_addr,
                                         uint32_t b_addr) {
  uint32_t b[kGW][2][4]; /* [group][pair p][b0, b1 of MMA 2p, b0, b1 of MMA 2p + 1] */
#pragma unroll
  for (int t = 0; t < kGW; ++t)
#pragma unroll
    for (int p = 0; p < 2; ++p)
      ldmatrix_x4(b[t][p], (b_addr ^ (p * kPairXor)) + t * 8 * kUnitRowBytes);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t a[kStrips][4];
#pragma unroll
    for (int s = 0; s < kStrips; ++s)
      ldmatrix_x4(a[s], (a_addr ^ (j * kStepXor)) + s * 16 * kUnitRowBytes);
#pragma unroll
    for (int t = 0; t < kGW; ++t)
#pragma unroll
      for (int s = 0; s < kStrips; ++s)
        mma_bf16_16816(acc[s][t], a[s][0], a[s][1], a[s][2], a[s][3], b[t][j >> 1][2 * (j & 1)],
                       b[t][j >> 1][2 * (j & 1) + 1]);
  }
}

/* Shared address of the partial sum for (token, row) in a slice: token-major rows of tile_n + 4
 * floats, so the MMA-fragment stores (lanes g, q -> rows g, tokens 2q) hit 32 distinct banks and
 * the epilogue reads 4 consecutive rows (columns of y) as one float4. */
__host__ __device__ __forceinline__ uint32_t partial_addr(uint32_t slice, int32_t tile_n, int tok,
                                                          int row) {
  return slice + 4u * (uint32_t)(tok * (tile_n + kPartialPad) + row);
}

template <int kGW>
__device__ __forceinline__ void partials_store(uint32_t slice, int32_t tile_n,
                                               const float (&acc)[kStrips][kGW][4], int row0,
                                               int tok0, int g, int q) {
#pragma unroll
  for (int s = 0; s < kStrips; ++s)
#pragma unroll
    for (int t = 0; t < kGW; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        sts_f32(partial_addr(slice, tile_n, tok0 + 8 * t + 2 * q + (c & 1),
                             row0 + 16 * s + g + 8 * (c >> 1)),
                acc[s][t][c]);
}

template <int kGW>
__device__ __forceinline__ void partials_add(uint32_t slice, int32_t tile_n,
                                             float (&acc)[kStrips][kGW][4], int row0, int tok0,
                                             int g, int q) {
#pragma unroll
  for (int s = 0; s < kStrips; ++s)
#pragma unroll
    for (int t = 0; t < kGW; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        acc[s][t][c] += lds_f32(partial_addr(slice, tile_n, tok0 + 8 * t + 2 * q + (c & 1),
                                             row0 + 16 * s + g + 8 * (c >> 1)));
}

/* One output value: column `col` of token `tok` of this launch. */
__device__ __forceinline__ void store_column(const Params &p, int tok, int col, float v) {
  if (col >= p.n) return;
  if (!p.split_epilogue) {
    p.y[(int64_t)tok * p.y_row_stride + col] = bf16_bits_no_negzero(v);
    return;
  }
  if (col < p.valid) p.logits[(int64_t)tok * p.logits_row_stride + col] = f32_no_negzero(v);
  if (col >= p.split)
    p.latent[(int64_t)tok * p.latent_row_stride + (col - p.split)] = bf16_bits_no_negzero(v);
}

template <int kGroups>
__global__ void __launch_bounds__(kThreads, 1)
    ws_gemm_kernel(const __grid_constant__ CUtensorMap w_map,
                   const __grid_constant__ CUtensorMap x_map, const Params p) {
  /* ---- checks ---------------------------------------------------------------------- */
  static_assert(kGroups % kTokenHalves == 0 && kGroups <= kMaxGroups, "token groups per launch");
  constexpr int kGW = kGroups / kTokenHalves; /* token groups per consumer warp */

  /* ---- shared memory: [ring of stages][full barriers][empty barriers] ----------------- */
  extern __shared__ __align__(kSwizzleAtomBytes) uint8_t smem_raw[];
  const SmemPlan plan = plan_smem(p.smem_bytes, p.tile_n, kGroups);
  const uint32_t ring =
      (smem_addr(smem_raw) + kSwizzleAtomBytes - 1) & ~(uint32_t)(kSwizzleAtomBytes - 1);
  uint64_t *full = reinterpret_cast<uint64_t *>(smem_raw + (ring - smem_addr(smem_raw)) +
                                                plan.stages * plan.stage_bytes);
  uint64_t *empty = full + plan.stages;

  /* ---- this CTA's piece: rows [n0, n0 + tile_n), units [u0, u0 + units) of K ----------- */
  const int rank = p.cluster > 1 ? (int)cluster_rank() : 0;
  const int n0 = (int)(blockIdx.x / (uint32_t)p.cluster) * p.tile_n;
  const int k_units = p.k / kUnitK;
  const int u0 = (int)((int64_t)rank * k_units / p.cluster);
  const int units = (int)((int64_t)(rank + 1) * k_units / p.cluster) - u0;

  const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x % 32);
  const int g = lane >> 2, q = lane & 3; /* MMA fragment coordinates */

  /* ---- barriers --------------------------------------------------------------------- */
  if (threadIdx.x == 0) {
    for (int s = 0; s < plan.stages; ++s) {
      mbar_init(&full[s], 1); /* the producer's arrive.expect_tx */
      mbar_init(&empty[s], (uint32_t)(plan.row_groups * kTokenHalves)); /* its consumers */
    }
    fence_barrier_init();
  }
  __syncthreads();
  /* Nothing below needs the dependents to wait for us: they may start now and prefetch their
   * own weights on the SMs we leave free or free up. */
  allow_dependents();

  float acc[kStrips][kGW][4];
#pragma unroll
  for (int s = 0; s < kStrips; ++s)
#pragma unroll
    for (int t = 0; t < kGW; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[s][t][c] = 0.0f;
  int kg = 0, row0 = 0, tok0 = 0;

  if (warp == kProducerWarp) {
    /* ---- producer: weights for the whole ring first, then wait, then x ----------------- */
    if (lane == 0) {
      prefetch_tensormap(&w_map);
      prefetch_tensormap(&x_map);
      const uint64_t evict_first = l2_evict_first_policy();
      const int prefill = units < plan.stages ? units : plan.stages;
      for (int s = 0; s < prefill; ++s) {
        mbar_arrive_expect_tx(&full[s], (uint32_t)plan.stage_bytes);
        tma_load_2d(ring + s * plan.stage_bytes, &w_map, (u0 + s) * kUnitK, n0, smem_addr(&full[s]),
                    evict_first);
      }
      wait_for_predecessor(); /* x may be the predecessor's output */
      for (int s = 0; s < prefill; ++s)
        tma_load_2d(ring + s * plan.stage_bytes + plan.w_bytes, &x_map, (u0 + s) * kUnitK, 0,
                    smem_addr(&full[s]));
      int slot = 0;
      uint32_t phase = 0; /* parity of the consumers' release of this slot's previous fill */
      for (int s = prefill; s < units; ++s) {
        mbar_wait(&empty[slot], phase);
        const uint32_t stage = ring + slot * plan.stage_bytes;
        mbar_arrive_expect_tx(&full[slot], (uint32_t)plan.stage_bytes);
        tma_load_2d(stage, &w_map, (u0 + s) * kUnitK, n0, smem_addr(&full[slot]), evict_first);
        tma_load_2d(stage + plan.w_bytes, &x_map, (u0 + s) * kUnitK, 0, smem_addr(&full[slot]));
        if (++slot == plan.stages) {
          slot = 0;
          phase ^= 1u;
        }
      }
    }
    __syncwarp();
  } else {
    /* ---- consumers: warp = (kg, rg, tg); stages kg, kg + KG, kg + 2 KG, ... -------------- */
    const int per_k_group = plan.row_groups * kTokenHalves;
    kg = warp / per_k_group;
    const int rg = (warp % per_k_group) % plan.row_groups;
    const int tg = (warp % per_k_group) / plan.row_groups;
    row0 = rg * kWarpRows;
    tok0 = tg * kGW * 8;
    const uint32_t a_lane = (uint32_t)(row0 * kUnitRowBytes) + a_lane_offset((uint32_t)lane);
    const uint32_t b_lane = (uint32_t)plan.w_bytes + (uint32_t)(tok0 * kUnitRowBytes) +
                            b_lane_offset((uint32_t)lane);
    int slot = kg; /* kg < k_groups <= stages; stages % k_groups == 0 */
    uint32_t phase = 0;
    for (int s = kg; s < units; s += plan.k_groups) {
      mbar_wait(&full[slot], phase);
      const uint32_t stage = ring + slot * plan.stage_bytes;
      mma_unit<kGW>(acc, stage + a_lane, stage + b_lane);
      __syncwarp(); /* every lane's reads of the slot precede the release */
      if (lane == 0) mbar_arrive(&empty[slot]);
      slot += plan.k_groups;
      if (slot >= plan.stages) {
        slot -= plan.stages;
        phase ^= 1u;
      }
    }

    /* ---- reduction 1: k-groups, in shared memory, in the order kg = 0, 1, 2, 3 ----------- */
    /* The slices reuse the ring: wait until every consumer is done with it. All copies issued
     * have landed, since every stage was waited on by its consumers. */
    named_barrier(kConsumerBarrier, kConsumerWarps * 32);
    if (kg > 0) partials_store<kGW>(ring + kg * plan.slice_bytes, p.tile_n, acc, row0, tok0, g, q);
    named_barrier(kConsumerBarrier, kConsumerWarps * 32);
    if (kg == 0) {
      for (int j = 1; j < plan.k_groups; ++j)
        partials_add<kGW>(ring + j * plan.slice_bytes, p.tile_n, acc, row0, tok0, g, q);
      partials_store<kGW>(ring, p.tile_n, acc, row0, tok0, g, q); /* slice 0 = the CTA's partial */
    }
  }

  /* ---- reduction 2: across the cluster, rank order 0..C-1, through DSMEM --------------- */
  __syncwarp(); /* the .aligned cluster barrier wants each warp converged (roles diverged) */
  if (p.cluster > 1)
    cluster_sync();
  else
    __syncthreads();
  wait_for_predecessor(); /* outputs: the predecessor may still read the buffers we overwrite */

  /* ---- epilogue: this CTA's rows [rank R/C, (rank+1) R/C) of the tile, 4 columns a thread - */
  const int rows_per_rank = p.tile_n / p.cluster; /* >= 8 */
  const int quads = rows_per_rank / 4;
  const int items = p.m * quads;
  for (int i = (int)threadIdx.x; i < items; i += kThreads) {
    const int tok = i / quads;
    const int row = rank * rows_per_rank + (i - tok * quads) * 4;
    const uint32_t addr = partial_addr(ring, p.tile_n, tok, row);
    float4 v;
    if (p.cluster > 1) {
      float4 part[kMaxCluster];
#pragma unroll
      for (int c = 0; c < kMaxCluster; ++c)
        if (c < p.cluster) part[c] = ld_cluster_f4(addr, (uint32_t)c);
      v = part[0];
#pragma unroll
      for (int c = 1; c < kMaxCluster; ++c)
        if (c < p.cluster) {
          v.x += part[c].x;
          v.y += part[c].y;
          v.z += part[c].z;
          v.w += part[c].w;
        }
    } else {
      v = lds_f4(addr);
    }
    const int col = n0 + row;
    store_column(p, tok, col + 0, v.x);
    store_column(p, tok, col + 1, v.y);
    store_column(p, tok, col + 2, v.z);
    store_column(p, tok, col + 3, v.w);
  }

  /* No CTA may leave while a cluster peer still reads its partials. */
  if (p.cluster > 1) cluster_sync();
}

/* ===================================================================================== */
/* Host side                                                                              */
/* ===================================================================================== */

constexpr int kGroupChoices[] = {2, 4, 8}; /* 8-token groups per launch: M <= 16, 32, 64 */
constexpr int kTileChoices[] = {128, 256, 64}; /* in order of preference on a tie */
constexpr int kClusterChoices[] = {1, 2, 4, 8};

using KernelFn = void (*)(CUtensorMap, CUtensorMap, Params);

KernelFn kernel_for_groups(int groups) {
  switch (groups) {
    case 2: return ws_gemm_kernel<2>;
    case 4: return ws_gemm_kernel<4>;
    default: return ws_gemm_kernel<8>;
  }
}

int groups_for_rows(int64_t m) { return m <= 16 ? 2 : (m <= 32 ? 4 : 8); }

/* cuTensorMapEncodeTiled from the driver, fetched once through the runtime so the extension
 * does not link libcuda. */
struct EncodeFn {
  PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  cudaError_t status = cudaSuccess;
};

const EncodeFn &encode_fn() {
  static const EncodeFn cached = [] {
    EncodeFn e;
    void *fn = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    e.status = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                cudaEnableDefault, &q);
#else /* CUDA 12.0 - 12.4 */
    e.status = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn, cudaEnableDefault, &q);
#endif
    if (e.status == cudaSuccess && (q != cudaDriverEntryPointSuccess || fn == nullptr))
      e.status = cudaErrorNotSupported;
    e.fn = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    return e;
  }();
  return cached;
}

/* A bf16 matrix [rows, cols] with a row stride in bytes, read in boxes of 64 columns x box_rows
 * rows into 128B-swizzled shared memory; boxes past the edge are zero-filled. */
cudaError_t encode_bf16_2d(CUtensorMap *map, const void *base, uint64_t rows, uint64_t cols,
                           uint64_t row_stride_bytes, uint32_t box_rows) {
  const EncodeFn &e = encode_fn();
  if (e.status != cudaSuccess) return e.status;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_stride_bytes};
  const cuuint32_t box[2] = {(cuuint32_t)kUnitK, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = e.fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(base), dims,
                          strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorInvalidValue;
}

/* Switches to `device` for the scope and back (configure must not move the caller's device). */
struct DeviceScope {
  int previous = -1;
  cudaError_t status = cudaSuccess;
  explicit DeviceScope(int device) {
    status = cudaGetDevice(&previous);
    if (status == cudaSuccess && previous != device) status = cudaSetDevice(device);
  }
  ~DeviceScope() {
    int now = -1;
    if (previous >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous)
      cudaSetDevice(previous);
  }
};

/* CTAs of one cluster size that can be resident at once with this shared memory. */
cudaError_t resident_ctas(int cluster, int smem_bytes, int sms, int *ctas) {
  KernelFn fn = kernel_for_groups(kMaxGroups);
  if (cluster == 1) {
    int blocks = 0;
    cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, fn, kThreads,
                                                                    (size_t)smem_bytes);
    *ctas = blocks * sms;
    return err;
  }
  cudaLaunchConfig_t cfg = {};
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = (unsigned)cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.gridDim = dim3((unsigned)cluster, 1, 1);
  cfg.blockDim = dim3(kThreads, 1, 1);
  cfg.dynamicSmemBytes = (size_t)smem_bytes;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  int clusters = 0;
  cudaError_t err = cudaOccupancyMaxActiveClusters(&clusters, fn, &cfg);
  *ctas = clusters * cluster;
  return err;
}

bool config_is_sane(const kx_gemm_config &c, int32_t n, int32_t k) {
  bool tile_ok = false, cluster_ok = false;
  for (int t : kTileChoices) tile_ok = tile_ok || c.tile_n == t;
  for (int cl : kClusterChoices) cluster_ok = cluster_ok || c.cluster == cl;
  if (!tile_ok || !cluster_ok || c.threads != kThreads || c.max_m != kMaxM) return false;
  if (c.cluster > k / kUnitK) return false;
  if ((int64_t)c.grid != ((int64_t)n + c.tile_n - 1) / c.tile_n * c.cluster) return false;
  for (int groups : kGroupChoices)
    if (!plan_fits(plan_smem(c.smem_bytes, c.tile_n, groups))) return false;
  return true;
}

}  // namespace kx_gemm

using namespace kx_gemm;

extern "C" cudaError_t kx_gemm_configure(int32_t n, int32_t k, int device, kx_gemm_config *config) {
  if (config == nullptr) return cudaErrorInvalidValue;
  memset(config, 0, sizeof(*config));
  if (n < 1 || k < kUnitK || k % kUnitK != 0) return cudaErrorInvalidValue;

  DeviceScope scope(device);
  if (scope.status != cudaSuccess) return scope.status;
  int major = 0, minor = 0, sms = 0, smem_optin = 0;
  cudaError_t err;
  if ((err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device)) ||
      (err = cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device)) ||
      (err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device)) ||
      (err = cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device)))
    return err;
  if (major != 9 || minor != 0) return cudaErrorInvalidDevice; /* sm_90a code only */

  /* All of shared memory: more ring stages = more weights requested before the wait. */
  const int smem_bytes = smem_optin;
  for (int groups : kGroupChoices) {
    err = cudaFuncSetAttribute(kernel_for_groups(groups),
                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
    if (err != cudaSuccess) return err;
  }

  /* The heuristic, in this order: fewest waves; fewest weight elements per CTA (the critical
   * path when every SM streams at the same rate); the tile order of kTileChoices; the smaller
   * cluster (earlier in kClusterChoices). */
  const int k_units = k / kUnitK;
  int64_t best_cost = -1;
  int best_waves = 0, best_tile = 0, best_cluster = 0;
  int64_t best_grid = 0;
  for (int tile_n : kTileChoices) {
    bool fits = true;
    for (int groups : kGroupChoices) fits = fits && plan_fits(plan_smem(smem_bytes, tile_n, groups));
    if (!fits) continue;
    for (int cluster : kClusterChoices) {
      if (cluster > k_units) continue;
      int resident = 0;
      err = resident_ctas(cluster, smem_bytes, sms, &resident);
      if (err != cudaSuccess) {
        cudaGetLastError(); /* an unsupported cluster size is not fatal: skip it */
        continue;
      }
      if (resident <= 0) continue;
      const int64_t grid = ((int64_t)n + tile_n - 1) / tile_n * cluster;
      if (grid > 0x7fffffff) continue;
      const int waves = (int)((grid + resident - 1) / resident);
      const int64_t cost = (int64_t)tile_n * ((k_units + cluster - 1) / cluster) * kUnitK;
      if (best_cost < 0 || waves < best_waves || (waves == best_waves && cost < best_cost)) {
        best_cost = cost;
        best_waves = waves;
        best_tile = tile_n;
        best_cluster = cluster;
        best_grid = grid;
      }
    }
  }
  if (best_cost < 0) return cudaErrorInvalidConfiguration;

  const char *pdl_env = getenv("KIMI_EXPERTS_PDL");
  config->grid = (int32_t)best_grid;
  config->cluster = best_cluster;
  config->smem_bytes = smem_bytes;
  config->max_m = kMaxM;
  config->tile_n = best_tile;
  config->threads = kThreads;
  config->waves = best_waves;
  config->pdl = (pdl_env != nullptr && strcmp(pdl_env, "0") == 0) ? 0 : 1;
  return cudaSuccess;
}

extern "C" size_t kx_gemm_scratch_bytes(int32_t, int32_t, const kx_gemm_config *) { return 0; }

extern "C" cudaError_t kx_gemm_run(const kx_gemm_args *a, cudaStream_t stream) {
  /* ---- checks: everything is validated before the first launch --------------------------- */
  if (a == nullptr) return cudaErrorInvalidValue;
  const kx_gemm_config &c = a->config;
  if (a->n < 1 || a->k < kUnitK || a->k % kUnitK != 0 || a->m < 0) return cudaErrorInvalidValue;
  if (!config_is_sane(c, a->n, a->k)) return cudaErrorInvalidValue;
  if (a->m == 0) return cudaSuccess;
  if (a->w == nullptr || ((uintptr_t)a->w & 15) != 0) return cudaErrorInvalidValue;
  if (a->x == nullptr || ((uintptr_t)a->x & 15) != 0) return cudaErrorInvalidValue;
  if (a->m > 1 && (a->x_row_stride % 8 != 0 || a->x_row_stride < a->k))
    return cudaErrorInvalidValue;
  if (!a->split_epilogue) {
    if (a->y == nullptr) return cudaErrorInvalidValue;
  } else {
    if (a->valid < 0 || a->split < a->valid || a->split > a->n) return cudaErrorInvalidValue;
    if (a->valid > 0 && a->logits == nullptr) return cudaErrorInvalidValue;
    if (a->split < a->n && a->latent == nullptr) return cudaErrorInvalidValue;
  }

  CUtensorMap w_map;
  cudaError_t err = encode_bf16_2d(&w_map, a->w, (uint64_t)a->n, (uint64_t)a->k,
                                   (uint64_t)a->k * 2, (uint32_t)c.tile_n);
  if (err != cudaSuccess) return err;

  /* ---- one launch per 64 rows of x ------------------------------------------------------ */
  for (int64_t r0 = 0; r0 < a->m; r0 += kMaxM) {
    const int rows = (int)((a->m - r0) < kMaxM ? (a->m - r0) : kMaxM);
    const int groups = groups_for_rows(rows);
    CUtensorMap x_map;
    const uint64_t x_stride = rows > 1 ? (uint64_t)a->x_row_stride * 2 : (uint64_t)a->k * 2;
    err = encode_bf16_2d(&x_map, a->x + r0 * a->x_row_stride, (uint64_t)rows, (uint64_t)a->k,
                         x_stride, (uint32_t)(8 * groups));
    if (err != cudaSuccess) return err;

    Params p;
    p.n = a->n;
    p.k = a->k;
    p.m = rows;
    p.tile_n = c.tile_n;
    p.cluster = c.cluster;
    p.smem_bytes = c.smem_bytes;
    p.split_epilogue = a->split_epilogue ? 1 : 0;
    p.valid = a->valid;
    p.split = a->split;
    p.y = a->split_epilogue ? nullptr : a->y + r0 * a->y_row_stride;
    p.y_row_stride = a->y_row_stride;
    p.logits = (a->split_epilogue && a->logits) ? a->logits + r0 * a->logits_row_stride : nullptr;
    p.logits_row_stride = a->logits_row_stride;
    p.latent = (a->split_epilogue && a->latent) ? a->latent + r0 * a->latent_row_stride : nullptr;
    p.latent_row_stride = a->latent_row_stride;

    cudaLaunchAttribute attrs[2];
    unsigned num_attrs = 0;
    if (c.cluster > 1) {
      attrs[num_attrs].id = cudaLaunchAttributeClusterDimension;
      attrs[num_attrs].val.clusterDim.x = (unsigned)c.cluster;
      attrs[num_attrs].val.clusterDim.y = 1;
      attrs[num_attrs].val.clusterDim.z = 1;
      ++num_attrs;
    }
    if (c.pdl) {
      attrs[num_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attrs[num_attrs].val.programmaticStreamSerializationAllowed = 1;
      ++num_attrs;
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3((unsigned)c.grid, 1, 1);
    cfg.blockDim = dim3(kThreads, 1, 1);
    cfg.dynamicSmemBytes = (size_t)c.smem_bytes;
    cfg.stream = stream;
    cfg.attrs = attrs;
    cfg.numAttrs = num_attrs;
    err = cudaLaunchKernelEx(&cfg, kernel_for_groups(groups), w_map, x_map, p);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}
