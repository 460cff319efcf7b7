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
 *     ranges of 64-wide "units" (k_range: equal, except that in a pair rank 0 streams 5/8 of K,
 *     so that rank 1 finishes early and its SM takes the next launch's CTA). kx_gemm_configure
 *     picks (R, C) deterministically: fewest waves (each wave pays the pipeline fill and the
 *     reduction again), then fewest weight bytes per CTA (= most SMs streaming), then R = 128
 *     before 256 before 64 (x is re-read once per tile, partial sums grow with R), then the smaller
 *     cluster (cheaper reduction).
 *     N=4096, K=7168 on the H200 -> R=64, C=2: 64 clusters x 2 = 128 CTAs of 64 rows x 4480 k
 *     (rank 0, 573 KB) or 2688 k (rank 1, 344 KB); R=128, C=4 streams fewer bytes per CTA, but
 *     fewer than 128 CTAs of 4-CTA clusters fit at once (a second wave: 22.7 us instead of 17.1
 *     in a dev harness).
 *   - Pipeline. One producer lane issues TMA tensor copies (cp.async.bulk.tensor, 128B swizzle) of
 *     one unit per stage: W[R rows x 64 k] and x[8G tokens x 64 k] (rows past N or M are zero-filled
 *     by the TMA), into a ring of stages guarded by full/empty mbarriers; two consumer warpgroups
 *     run the MMAs. One copy per R x 128 bytes of weights (8-32 KB) keeps the producer's work small.
 *   - Weight-stationary + programmatic dependent launch. The kernel triggers its dependents at once
 *     (griddepcontrol.launch_dependents), and the producer fills EVERY ring stage with weights
 *     BEFORE griddepcontrol.wait: at R = 64, 176 KB (M <= 16) to 104 KB (M = 64, beside the
 *     push's area) of a 344-573 KB slice is requested while the predecessor still runs. Only x
 *     (which the predecessor may write) and the outputs wait. The rest of the slice streams
 *     through the ring afterwards.
 *   - MMA. wgmma m64nNk16 bf16 with both operands read by the tensor core from the TMA's
 *     128B-swizzled tiles as they land (K-major, the layout wgmma's descriptors name directly):
 *     64 weight rows on its M side, all 8G token rows of the launch on its N side (N = 16, 32 or
 *     64), 4 instructions per 64-row block per unit, no fragment loads. A warpgroup keeps one
 *     unit's instructions in flight while it waits for the next unit's copies.
 *   - Warpgroups. Consumer warpgroup w owns the 64-row blocks w, w + 2 of the tile (R = 64 leaves
 *     the second one idle) and reads every stage.
 *   - Reduction, deterministic: rank order 0..C-1, whoever finishes first; two ways, which
 *     pushed_reduction picks by measurement (a template parameter, so the reduce-scattering
 *     kernels compile as they did alone). Pushed (pairs): rank 1 sends its fp32 accumulators
 *     from registers into rank 0's shared memory (st.async, counted in bytes on an mbarrier
 *     there) and leaves at once, so its SM takes the next launch's CTA early; rank 0 adds them to
 *     its own and writes the whole tile from its registers. Reduce-scattered (no cluster, or 4 or
 *     8 CTAs): the warpgroups write their partial sums to shared memory (over the drained ring),
 *     then between two cluster barriers rank c sums rows [c R/C, (c+1) R/C) of all C CTAs'
 *     partials through distributed shared memory and writes them.
 *   - Batch invariance. Tokens always sit in the same MMA column (token i -> column i of its
 *     64-row block) and the summation order depends only on (N, K, config), never on M, timing
 *     or the token's neighbours: a token's output is bit-identical at every batch size (the
 *     tensor core computes every output element of a wgmma alike, whatever its N).
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
#include "pipeline.cuh" /* mbarriers, L2 policy, PDL, named barriers, clusters: shared with experts.cu */

namespace kx_gemm {

using kx::allow_dependents;
using kx::cluster_addr;
using kx::cluster_arrive;
using kx::cluster_rank;
using kx::cluster_sync;
using kx::cluster_wait;
using kx::fence_barrier_init;
using kx::l2_evict_first_policy;
using kx::mbar_arrive;
using kx::mbar_arrive_expect_tx;
using kx::mbar_init;
using kx::mbar_wait;
using kx::named_barrier;
using kx::RingPos;
using kx::smem_addr;
using kx::wait_for_predecessor;

/* ===================================================================================== */
/* Constants                                                                              */
/* ===================================================================================== */

constexpr int kUnitK = 64;                 /* K elements per pipeline stage ("unit") */
constexpr int kUnitRowBytes = kUnitK * 2;  /* one unit row of bf16 = one 128-byte swizzle span */
constexpr int kSwizzleAtomBytes = 1024;    /* 128B swizzle repeats every 8 rows x 128 bytes */
constexpr int kMmaK = 16;                  /* K of one wgmma (bf16) */
constexpr int kBlockRows = 64;             /* weight rows of one wgmma (its M) */
constexpr int kConsumerWarpgroups = 2;
constexpr int kConsumerWarps = 4 * kConsumerWarpgroups;
constexpr int kProducerWarp = kConsumerWarps; /* the last warp; only its lane 0 issues copies */
constexpr int kThreads = (kConsumerWarps + 1) * 32;
constexpr int kMaxM = 64;                  /* rows of x per launch */
constexpr int kMaxStages = 32;
constexpr int kMaxCluster = 8;             /* portable cluster size limit */
constexpr int kPartialPad = 4;             /* floats of padding per token row of a partial tile */
constexpr int kConsumerBarrier = 1;        /* named barrier id for the consumer warps (0 = syncthreads) */

static_assert(kUnitRowBytes == 128, "a unit row must be exactly one 128-byte swizzle span");
static_assert((kBlockRows * kUnitRowBytes) % kSwizzleAtomBytes == 0 &&
                  (8 * kUnitRowBytes) % kSwizzleAtomBytes == 0,
              "every 64-row W block and the x part of a stage start on a 1024-byte swizzle atom");
static_assert(kPartialPad % 4 == 0 && kBlockRows % 4 == 0,
              "partial rows must keep 16-byte alignment for the epilogue's float4 reads");
static_assert((2 * kPartialPad) % 32 == 8,
              "2 * (tile_n + pad) % 32 == 8 makes the accumulator stores of lanes (g, q) at row g, "
              "token 2q hit 32 distinct banks (tile_n is a multiple of 32)");
static_assert(kThreads <= 1024, "one CTA");

/* ===================================================================================== */
/* Layout helpers, shared by the kernel and the host (one place for the arithmetic)       */
/* ===================================================================================== */

/* How the cluster's CTAs combine their partial sums (the kernel comment, "Reduction"): pushed to
 * rank 0, which sums them while the others leave, or reduce-scattered between two cluster
 * barriers. Measured on the H200 (sessions 25-27), the push wins for pairs once rank 0 streams
 * the larger part of K (k_range) and writes the tile from its registers, at every M and tile
 * (session 27, the last case: (7168, 2048) M = 64, tiles of 128 rows, -1.3 us); with more CTAs
 * it is slower (+0.15 to +1.5 us in session 25: rank 0 waits for and writes more). */
__host__ __device__ inline bool pushed_reduction(int32_t cluster) { return cluster == 2; }

/* Rank `rank`'s K units [*first, *first + *count) of k_units. Even, except in a pair: rank 0
 * streams 5/8 of K, so that rank 1 sends its sums (pushed) and leaves early and its SM takes the
 * next launch's CTA (session 26, against an even split: -0.6 to -1.2 us at M <= 32; slower at
 * M = 64, which must split alike: the summation order may not depend on M, "Batch invariance";
 * 9/16 measured in session 27: -0.5 us at M = 64, +0.65 at M <= 16). Session 72 swept 7/16 to
 * 13/16: 5/8 is the best in a chain at every M <= 32; a launch that follows nothing (no PDL) runs
 * 1/2 or 3/4 ~0.7 us faster at M <= 16, which a chain pays back +0.4 to +1.75. */
__host__ __device__ inline void k_range(int rank, int k_units, int cluster, int *first,
                                        int *count) {
  if (cluster == 2) {
    int lead = (5 * k_units + 4) / 8;
    lead = lead < 1 ? 1 : (lead > k_units - 1 ? k_units - 1 : lead);
    *first = rank == 0 ? 0 : lead;
    *count = rank == 0 ? lead : k_units - lead;
    return;
  }
  *first = (int)((int64_t)rank * k_units / cluster);
  *count = (int)((int64_t)(rank + 1) * k_units / cluster) - *first;
}

/* Shared-memory plan of one launch: [ring of stages][full barriers][empty barriers][the
 * received barrier, 16 bytes][received accumulators]. After the K loop the partial sums reuse
 * the ring. The received area (rank 0 of a pushed reduction) is outside the ring because the
 * peers send whenever they finish, while rank 0 may still be reading its ring. */
struct SmemPlan {
  int32_t w_bytes;     /* W part of a stage: tile_n rows x 128 bytes */
  int32_t x_bytes;     /* x part of a stage: 8 * groups token rows x 128 bytes */
  int32_t stage_bytes;
  int32_t stages;      /* ring depth */
  int32_t slice_bytes; /* the CTA's partial sums: fp32 [8 * groups][tile_n + pad] */
  int32_t peer_bytes;  /* one CTA's accumulators as it sends them: fp32 tile_n x 8 * groups */
  int32_t recv_bytes;  /* pushed reduction: the other CTAs' accumulators, received by rank 0 */
};

__host__ __device__ inline SmemPlan plan_smem(int32_t smem_bytes, int32_t tile_n, int32_t groups,
                                              int32_t cluster) {
  SmemPlan p;
  p.w_bytes = tile_n * kUnitRowBytes;
  p.x_bytes = 8 * groups * kUnitRowBytes;
  p.stage_bytes = p.w_bytes + p.x_bytes;
  p.peer_bytes = tile_n * 8 * groups * 4;
  p.recv_bytes = pushed_reduction(cluster) ? (cluster - 1) * p.peer_bytes : 0;
  /* two 8-byte mbarriers per stage; kSwizzleAtomBytes of slack to align the ring */
  const int32_t received = p.recv_bytes > 0 ? 16 + p.recv_bytes : 0; /* its barrier, its area */
  const int32_t s = (smem_bytes - kSwizzleAtomBytes - received) / (p.stage_bytes + 16);
  p.stages = s < kMaxStages ? s : kMaxStages;
  p.slice_bytes = 8 * groups * (tile_n + kPartialPad) * 4;
  return p;
}

/* One stage to read and one in flight, and the partial sums must fit in the ring they reuse. */
__host__ __device__ inline bool plan_fits(const SmemPlan &p) {
  return p.stages >= 2 && p.slice_bytes <= p.stages * p.stage_bytes;
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

/* 16 bytes of CTA `rank`'s shared memory at the address `addr` has in this CTA. */
__device__ __forceinline__ float4 ld_cluster_f4(uint32_t addr, uint32_t rank) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(cluster_addr(addr, rank))
               : "memory");
  return v;
}

/* 16 bytes into another CTA's shared memory, counted in bytes on its mbarrier there; the
 * sender does not wait for it (nothing of the sender's is read). */
__device__ __forceinline__ void st_async_f4(uint32_t remote_addr, const float *v, uint32_t remote_bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
               ::"r"(remote_addr), "f"(v[0]), "f"(v[1]), "f"(v[2]), "f"(v[3]), "r"(remote_bar)
               : "memory");
}

__device__ __forceinline__ void sts_f32(uint32_t addr, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(addr), "f"(v) : "memory");
}

__device__ __forceinline__ float4 lds_f4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

/* ---- wgmma (sm_90a) ---------------------------------------------------------------- */

/* Shared-memory matrix descriptor of a K-major bf16 tile that the TMA wrote with 128B swizzle
 * into a 1024-byte aligned buffer: rows of 128 bytes (64 k), 8-row swizzle atoms 1024 bytes
 * apart (the stride byte offset); the leading byte offset is unused for swizzled K-major tiles.
 * 16 k further along a row is +32 bytes on the start address (+2 in the descriptor); the
 * hardware applies the swizzle to that address as the TMA did. */
__device__ __forceinline__ uint64_t sw128_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)1 << 16 |
         (uint64_t)(kSwizzleAtomBytes >> 4) << 32 | (uint64_t)1 << 62;
}
constexpr uint64_t kDescStepK = (kMmaK * 2) >> 4;                      /* +16 k */
constexpr uint64_t kDescStepBlock = (kBlockRows * kUnitRowBytes) >> 4; /* +64 rows */

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
/* Waits until at most kPending of the warpgroup's committed groups are unfinished. */
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

/* d[64 x kN] += A[64 x 16] B[16 x kN], A = 64 weight rows at a, B = kN token rows at b (both
 * K-major descriptors), fp32. Accumulator fragment: d[4 i + c] of lane l in warp w of the
 * warpgroup is weight row 16 w + l / 4 + 8 (c / 2), token 8 i + 2 (l % 4) + c % 2. The three
 * token widths differ only in their register lists. */
template <int kN>
__device__ __forceinline__ void wgmma_bf16(float (&d)[kN / 2], uint64_t a, uint64_t b) {
  static_assert(kN == 16 || kN == 32 || kN == 64, "n16, n32 or n64");
#define KX_WGMMA_TAIL " p, 1, 1, 0, 0;\n}\n"
#define KX_WGMMA_HEAD(N) "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\nwgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 "
  if constexpr (kN == 16) {
    asm volatile(KX_WGMMA_HEAD(16) "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9," KX_WGMMA_TAIL
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "l"(a), "l"(b));
  } else if constexpr (kN == 32) {
    asm volatile(KX_WGMMA_HEAD(32)
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17," KX_WGMMA_TAIL
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "l"(a), "l"(b));
  } else {
    asm volatile(KX_WGMMA_HEAD(64)
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
                 "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33,"
                 KX_WGMMA_TAIL
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31])
                 : "l"(a), "l"(b));
  }
#undef KX_WGMMA_HEAD
#undef KX_WGMMA_TAIL
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

/* Shared address of the partial sum for (token, row): token-major rows of tile_n + 4 floats, so
 * the accumulator stores (lanes g, q -> rows g, tokens 2q) hit 32 distinct banks and the
 * epilogue reads 4 consecutive rows (columns of y) as one float4. */
__host__ __device__ __forceinline__ uint32_t partial_addr(uint32_t slice, int32_t tile_n, int tok,
                                                          int row) {
  return slice + 4u * (uint32_t)(tok * (tile_n + kPartialPad) + row);
}

/* Where accumulator i of consumer lane (g, q) = (lane / 4, lane % 4) of `warp`, warpgroup wg,
 * block b lies in the tile: its token (the wgmma's column) and its row of W (the wgmma m64nNk16
 * fragment layout), each as the lane's first value's plus a step that depends on (i, b) alone. */
__device__ __forceinline__ int token_step(int i) { return 8 * (i >> 2) + (i & 1); }
__device__ __forceinline__ int row_step(int i, int b) {
  return b * kConsumerWarpgroups * kBlockRows + 8 * ((i >> 1) & 1);
}
__device__ __forceinline__ int fragment_token(int i, int q) { return 2 * q + token_step(i); }
__device__ __forceinline__ int fragment_row(int i, int b, int wg, int warp, int g) {
  return wg * kBlockRows + 16 * (warp % 4) + g + row_step(i, b);
}

/* Byte offset of 16-byte piece j of a lane's pushed accumulators (kPieces pieces a thread, a power
 * of two). The pieces of lane l go to j ^ f(l), so that for every j the 8 lanes of a quarter warp
 * cover all 32 banks: unswizzled, the 128-byte fragments of M = 64 put every lane of a warp on the
 * same 4 banks, and rank 0's reads of them took ~900 cycles at the stream's end (session 84). */
template <int kPieces>
__device__ __forceinline__ uint32_t pushed_piece(int j, int lane) {
  static_assert(kPieces > 0 && (kPieces & (kPieces - 1)) == 0, "the XOR swizzle needs a power of two");
  constexpr int kSpan = kPieces < 8 ? kPieces : 8;
  constexpr int kLanesPerStep = kPieces < 8 ? 8 / kPieces : 1;
  return (uint32_t)((j ^ ((lane / kLanesPerStep) & (kSpan - 1))) * 16);
}

/* Where accumulators acc[b][i .. i + 3] (i % 4 == 0) of a lane's pushed fragment lie: the sender's
 * st.async and rank 0's reads both take it from here, so the two layouts cannot drift apart. */
template <int kN, int kBlocks>
__device__ __forceinline__ uint32_t pushed_offset(int b, int i, int lane) {
  return pushed_piece<kBlocks * kN / 8>((b * (kN / 2) + i) / 4, lane);
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

/* Rank 0 of a pushed reduction writes the tile's sums from its registers. A plain tile inside y
 * (all but a ragged last one) takes one address a lane and a constant offset a value: store_column's
 * per-value checks made each store ~100 cycles on the one warp a scheduler holds (session 84). */
template <int kN, int kBlocks>
__device__ __forceinline__ void store_tile(const Params &p, const float (&acc)[kBlocks][kN / 2],
                                           int n0, int wg, int warp, int lane) {
  const int g = lane >> 2, q = lane & 3;
  if (!p.split_epilogue && n0 + p.tile_n <= p.n) {
    uint16_t *const y = p.y + (int64_t)fragment_token(0, q) * p.y_row_stride + n0 +
                        fragment_row(0, 0, wg, warp, g);
#pragma unroll
    for (int b = 0; b < kBlocks; ++b)
#pragma unroll
      for (int i = 0; i < kN / 2; ++i)
        if (fragment_token(i, q) < p.m)
          y[token_step(i) * p.y_row_stride + row_step(i, b)] = bf16_bits_no_negzero(acc[b][i]);
    return;
  }
#pragma unroll
  for (int b = 0; b < kBlocks; ++b)
#pragma unroll
    for (int i = 0; i < kN / 2; ++i) {
      const int tok = fragment_token(i, q);
      if (tok < p.m) store_column(p, tok, n0 + fragment_row(i, b, wg, warp, g), acc[b][i]);
    }
}

/* kGroups: 8-token groups per launch (M <= 16, 32, 64); kBlocks: 64-row blocks per consumer
 * warpgroup (1 for tile_n 64 or 128, 2 for 256), compile-time so that no wgmma sits behind a
 * branch (the compiler would serialize them); kPush: pushed_reduction(cluster). */
template <int kGroups, int kBlocks, bool kPush>
__global__ void __launch_bounds__(kThreads, 1)
    ws_gemm_kernel(const __grid_constant__ CUtensorMap w_map,
                   const __grid_constant__ CUtensorMap x_map, const Params p) {
  static_assert(kGroups == 2 || kGroups == 4 || kGroups == 8, "a wgmma N of 16, 32 or 64 tokens");
  constexpr int kN = 8 * kGroups; /* token rows of a launch = the wgmma's N */

  /* ---- shared memory (SmemPlan) ------------------------------------------------------ */
  extern __shared__ __align__(kSwizzleAtomBytes) uint8_t smem_raw[];
  const SmemPlan plan = plan_smem(p.smem_bytes, p.tile_n, kGroups, kPush ? p.cluster : 1);
  const uint32_t ring =
      (smem_addr(smem_raw) + kSwizzleAtomBytes - 1) & ~(uint32_t)(kSwizzleAtomBytes - 1);
  uint64_t *full = reinterpret_cast<uint64_t *>(smem_raw + (ring - smem_addr(smem_raw)) +
                                                plan.stages * plan.stage_bytes);
  uint64_t *empty = full + plan.stages;
  uint64_t *received = empty + plan.stages; /* pushed, rank 0: every peer's accumulators are in */
  const uint32_t recv = smem_addr(received) + 16;

  /* ---- this CTA's piece: rows [n0, n0 + tile_n), units [u0, u0 + units) of K ----------- */
  const int rank = p.cluster > 1 ? (int)cluster_rank() : 0;
  const int n0 = (int)(blockIdx.x / (uint32_t)p.cluster) * p.tile_n;
  const int k_units = p.k / kUnitK;
  int u0, units;
  k_range(rank, k_units, p.cluster, &u0, &units);

  const int warp = (int)(threadIdx.x / 32), lane = (int)(threadIdx.x % 32);
  /* Consumer warpgroup wg owns the tile's 64-row blocks wg + 2 b, b < kBlocks; at tile_n = 64
   * warpgroup 1 has none. */
  const int active_warpgroups = p.tile_n / kBlockRows < kConsumerWarpgroups
                                    ? p.tile_n / kBlockRows
                                    : kConsumerWarpgroups;

  /* ---- barriers --------------------------------------------------------------------- */
  if (threadIdx.x == 0) {
    for (int s = 0; s < plan.stages; ++s) {
      mbar_init(&full[s], 1); /* the producer's arrive.expect_tx */
      mbar_init(&empty[s], (uint32_t)(4 * active_warpgroups)); /* every consumer warp */
    }
    if (kPush) {
      mbar_init(received, 1);
      /* rank 0 expects every peer's bytes before any can arrive (the cluster barrier below) */
      if (rank == 0) mbar_arrive_expect_tx(received, (uint32_t)plan.recv_bytes);
    }
    fence_barrier_init();
  }
  __syncthreads();
  if constexpr (kPush) cluster_arrive(); /* the peers may send to our barrier once all arrived */
  /* Nothing below needs the dependents to wait for us: they may start now and prefetch their
   * own weights on the SMs we leave free or free up. */
  allow_dependents();

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
      RingPos at; /* parity: of the consumers' release of this slot's previous fill */
      for (int s = prefill; s < units; ++s, at.advance(plan.stages)) {
        mbar_wait(&empty[at.stage], at.parity);
        const uint32_t stage = ring + at.stage * plan.stage_bytes;
        mbar_arrive_expect_tx(&full[at.stage], (uint32_t)plan.stage_bytes);
        tma_load_2d(stage, &w_map, (u0 + s) * kUnitK, n0, smem_addr(&full[at.stage]), evict_first);
        tma_load_2d(stage + plan.w_bytes, &x_map, (u0 + s) * kUnitK, 0, smem_addr(&full[at.stage]));
      }
    }
    __syncwarp();
  } else {
    /* ---- consumers: warpgroup wg, its blocks wg + 2 b of every stage -------------------- */
    const int wg = warp / 4;
    const bool active = wg < active_warpgroups;
    float acc[kBlocks][kN / 2];
#pragma unroll
    for (int b = 0; b < kBlocks; ++b)
#pragma unroll
      for (int i = 0; i < kN / 2; ++i) acc[b][i] = 0.0f;

    if (active) {
      const uint64_t a0 = sw128_desc(ring + wg * kBlockRows * kUnitRowBytes);
      const uint64_t b0 = sw128_desc(ring + plan.w_bytes);
      const uint64_t stage_step = (uint64_t)(plan.stage_bytes >> 4);
      RingPos pos;
      int held = -1; /* the slot whose wgmmas may still be reading it */
      for (int s = 0; s < units; ++s, pos.advance(plan.stages)) {
        mbar_wait(&full[pos.stage], pos.parity);
        const uint64_t at = pos.stage * stage_step;
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < kUnitK / kMmaK; ++j)
#pragma unroll
          for (int b = 0; b < kBlocks; ++b)
            wgmma_bf16<kN>(acc[b], a0 + at + b * kConsumerWarpgroups * kDescStepBlock + j * kDescStepK,
                             b0 + at + j * kDescStepK);
        wgmma_commit();
        if (held >= 0) {
          wgmma_wait<1>(); /* the previous unit's wgmmas are done with their slot */
          if (lane == 0) mbar_arrive(&empty[held]);
        }
        held = pos.stage;
      }
      wgmma_wait<0>();
      if (lane == 0) mbar_arrive(&empty[held]);
    }

    /* ---- pushed reduction: ranks 1..C-1 send their accumulators to rank 0 and leave ----- */
    /* Thread t's fragment goes to floats [t kBlocks kN / 2, + kBlocks kN / 2) of the sender's
     * block, its 16-byte pieces in pushed_offset's order, so rank 0's thread t finds its own
     * fragment's partners at the same place. */
    const uint32_t fragment = recv + (uint32_t)threadIdx.x * kBlocks * (kN / 2) * 4;
    if (kPush && rank > 0) {
      cluster_wait(); /* rank 0's barrier is initialized and armed */
      if (active) {
        const uint32_t dst = cluster_addr(fragment + (uint32_t)(rank - 1) * plan.peer_bytes, 0);
        const uint32_t bar = cluster_addr(smem_addr(received), 0);
#pragma unroll
        for (int b = 0; b < kBlocks; ++b)
#pragma unroll
          for (int i = 0; i < kN / 2; i += 4)
            st_async_f4(dst + pushed_offset<kN, kBlocks>(b, i, lane), &acc[b][i], bar);
      }
      return;
    }
    const int g = lane >> 2, q = lane & 3;
    if constexpr (kPush) {
      /* ---- rank 0: the tile's sums, then straight from registers to the outputs ---------- */
      if (active) {
        mbar_wait(received, 0);
        /* deterministic: rank order 0, 1, .., C-1, whoever finished first */
        for (int c = 1; c < p.cluster; ++c) {
          const uint32_t from = fragment + (uint32_t)(c - 1) * plan.peer_bytes;
#pragma unroll
          for (int b = 0; b < kBlocks; ++b)
#pragma unroll
            for (int i = 0; i < kN / 2; i += 4) {
              const float4 v = lds_f4(from + pushed_offset<kN, kBlocks>(b, i, lane));
              acc[b][i] += v.x;
              acc[b][i + 1] += v.y;
              acc[b][i + 2] += v.z;
              acc[b][i + 3] += v.w;
            }
        }
        wait_for_predecessor(); /* outputs: the predecessor may still read what we overwrite */
        store_tile<kN, kBlocks>(p, acc, n0, wg, warp, lane);
      }
    } else {
      /* ---- the CTA's partial sums, over the drained ring ----------------------------------- */
      named_barrier(kConsumerBarrier, kConsumerWarps * 32); /* nobody reads the ring any more */
      if (active)
#pragma unroll
        for (int b = 0; b < kBlocks; ++b)
#pragma unroll
          for (int i = 0; i < kN / 2; ++i)
            sts_f32(partial_addr(ring, p.tile_n, fragment_token(i, q),
                                 fragment_row(i, b, wg, warp, g)),
                    acc[b][i]);
    }
  }

  /* ---- reduction across the cluster, rank order 0..C-1, through DSMEM ----------------- */
  __syncwarp(); /* the .aligned cluster barriers want each warp converged (roles diverged) */
  if constexpr (kPush) {
    cluster_wait(); /* every thread waits once (the senders' MMA warps did above) */
    return;
  }
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
      float4 parts[kMaxCluster];
#pragma unroll
      for (int c = 0; c < kMaxCluster; ++c)
        if (c < p.cluster) parts[c] = ld_cluster_f4(addr, (uint32_t)c);
      v = parts[0];
#pragma unroll
      for (int c = 1; c < kMaxCluster; ++c)
        if (c < p.cluster) {
          v.x += parts[c].x;
          v.y += parts[c].y;
          v.z += parts[c].z;
          v.w += parts[c].w;
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

template <int kGroups>
KernelFn kernel_for_groups(int tile_n, int cluster) {
  const bool two = tile_n > kConsumerWarpgroups * kBlockRows; /* 2 blocks per warpgroup */
  if (pushed_reduction(cluster))
    return two ? ws_gemm_kernel<kGroups, 2, true> : ws_gemm_kernel<kGroups, 1, true>;
  return two ? ws_gemm_kernel<kGroups, 2, false> : ws_gemm_kernel<kGroups, 1, false>;
}

KernelFn kernel_for(int groups, int tile_n, int cluster) {
  switch (groups) {
    case 2: return kernel_for_groups<2>(tile_n, cluster);
    case 4: return kernel_for_groups<4>(tile_n, cluster);
    default: return kernel_for_groups<8>(tile_n, cluster);
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
 * rows into 128B-swizzled shared memory; boxes past the edge are zero-filled. promotion: how much
 * of each box row's line the L2 fetches. */
cudaError_t encode_bf16_2d(CUtensorMap *map, const void *base, uint64_t rows, uint64_t cols,
                           uint64_t row_stride_bytes, uint32_t box_rows, CUtensorMapL2promotion promotion) {
  const EncodeFn &e = encode_fn();
  if (e.status != cudaSuccess) return e.status;
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_stride_bytes};
  const cuuint32_t box[2] = {(cuuint32_t)kUnitK, box_rows};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult r = e.fn(map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<void *>(base), dims,
                          strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
                          CU_TENSOR_MAP_SWIZZLE_128B, promotion,
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

/* CTAs of `fn` in clusters of `cluster` that can be resident at once with this shared memory. */
cudaError_t resident_ctas(KernelFn fn, int cluster, int smem_bytes, int sms, int *ctas) {
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
    if (!plan_fits(plan_smem(c.smem_bytes, c.tile_n, groups, c.cluster))) return false;
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
  for (int groups : kGroupChoices)
    for (int tile_n : kTileChoices)
      for (int cluster : {1, 2}) { /* every kernel: reduce-scattering and (pairs) pushing */
        err = cudaFuncSetAttribute(kernel_for(groups, tile_n, cluster),
                                   cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
        if (err != cudaSuccess) return err;
      }

  /* The heuristic, in this order: fewest waves; fewest weight elements per CTA (the critical
   * path when every SM streams at the same rate; counted for an even split of K, as measured
   * before k_range gave a pair's rank 0 the larger part); the tile order of kTileChoices; the
   * smaller cluster (earlier in kClusterChoices). */
  const int k_units = k / kUnitK;
  int64_t best_cost = -1;
  int best_waves = 0, best_tile = 0, best_cluster = 0;
  int64_t best_grid = 0;
  for (int tile_n : kTileChoices) {
    for (int cluster : kClusterChoices) {
      if (cluster > k_units) continue;
      bool fits = true; /* a pushed reduction's received area takes ring stages */
      for (int groups : kGroupChoices)
        fits = fits && plan_fits(plan_smem(smem_bytes, tile_n, groups, cluster));
      if (!fits) continue;
      int resident = 0;
      KernelFn widest = kernel_for(kMaxM / 8, tile_n, cluster);
      err = resident_ctas(widest, cluster, smem_bytes, sms, &resident);
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

  /* W's box rows are exactly one 128-byte unit row each; 256-byte promotion also fetched the next
   * unit's half of the line early, which was 0.15-0.35 us slower at N = 4096 (M <= 16) and 0.3-0.45
   * at (7168, 2048) (session 65). x keeps it: without, every shape reads the same within 0.04 us
   * (session 72; x is an L2 hit after its first fetch). */
  CUtensorMap w_map;
  cudaError_t err = encode_bf16_2d(&w_map, a->w, (uint64_t)a->n, (uint64_t)a->k,
                                   (uint64_t)a->k * 2, (uint32_t)c.tile_n, CU_TENSOR_MAP_L2_PROMOTION_NONE);
  if (err != cudaSuccess) return err;

  /* ---- one launch per 64 rows of x ------------------------------------------------------ */
  for (int64_t r0 = 0; r0 < a->m; r0 += kMaxM) {
    const int rows = (int)((a->m - r0) < kMaxM ? (a->m - r0) : kMaxM);
    const int groups = groups_for_rows(rows);
    CUtensorMap x_map;
    const uint64_t x_stride = rows > 1 ? (uint64_t)a->x_row_stride * 2 : (uint64_t)a->k * 2;
    err = encode_bf16_2d(&x_map, a->x + r0 * a->x_row_stride, (uint64_t)rows, (uint64_t)a->k,
                         x_stride, (uint32_t)(8 * groups), CU_TENSOR_MAP_L2_PROMOTION_L2_256B);
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
    err = cudaLaunchKernelEx(&cfg, kernel_for(groups, c.tile_n, c.cluster), w_map, x_map, p);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}
