/* experts.cu: one MoE layer's routed experts in one persistent launch (SPEC 3).
 *
 * Math, per token t and slot j with e = ids[t, j]:
 *   xq = MXFP8(x[t]) (rceil); a = W13[e] . xq; h = SiTU(a); hq = MXFP8(h);
 *   out[t K + j] = bf16(W2[e] . hq)   or, combined, z[t] = bf16(sum_j w[t,j] out[t K + j]).
 *
 * Why it is shaped this way: decode is memory-bound (k3-tp8 B=1 reads 35 MB of FP4 and
 * does almost no math), so the kernel is a weight stream. One CTA per SM, 24 warps:
 *   - a weight producer fills a 4-stage shared-memory ring with one 17 KB bulk copy per
 *     stage (the copy engine is paid per copy: moe_layout.cuh), never waiting for data;
 *   - two activation producers, on alternate tiles, copy the unit's activation rows into
 *     the same stage (a bulk copy per x row for FC1, one per unit block of hidden rows
 *     for FC2), waiting for them where other CTAs produce them;
 *   - 16 MMA warps load a stage into registers, widen FP4 to f16 with bit
 *     operations (mx.cuh: Hopper's e4m3 mma.sync is emulated through conversions), run
 *     two mma.sync m16n8k16 per 16x32 unit (weights on the 16-row side, tokens on the
 *     8-column side) and fold each 32-block's weight scale into fp32 sums (activation
 *     scales are folded into their f16 values: mx.cuh), then release the stage;
 *   - 5 epilogue warps take each tile's partial sums, so the MMA warps never wait on
 *     global memory.
 * Tiles are dealt round-robin over the grid: all FC1 tiles first, then all FC2 tiles, so
 * FC2 weights stream while the last FC1 tiles finish.
 *
 * Phases inside the launch (no grid-wide barrier on the weight path):
 *   0. before griddepcontrol.wait: barriers and routing tables cleared (overlaps the
 *      previous kernel under programmatic dependent launch; this launch lets its own
 *      dependents start at once, so they do the same on SMs that ours leave early);
 *      one-token launches also run their routing and x's quantization once on dummy
 *      data there, which warms the code of their start (warm_then_run);
 *   1. every CTA routes all pairs itself (route.cuh, on its 8 non-MMA warps, or on one
 *      warp when a launch has at most 32 pairs) -> units of <= 8 tokens; meanwhile the MMA
 *      warps quantize their share of x to MXFP8 in scratch and a grid-wide counter says
 *      done (the activation producers wait for it before their first activation copy);
 *   3. FC1 tile = 2 x (16 gate + 16 up rows) of one unit over all of H; the 16 warps split K,
 *      an epilogue warp reduces in a fixed order (deterministic), applies SiTU, stores h
 *      (fp32). The CTA that finishes a unit's last FC1 tile quantizes its h to MXFP8
 *      and releases it (tagged launches, whose FC1 takes few rounds: each tile quantizes its
 *      own blocks and stores them as tagged words, which need no release);
 *   4. FC2 tile = 64, 128 or 256 output rows of one unit; an activation producer waits for
 *      the unit's hidden rows, or (tagged) the activation producers take the chunks in turn
 *      and poll the tagged words of each chunk's blocks (the weights are already on their
 *      way); bf16 results go to every slot that routed the token there (one token and one
 *      MMA warp per strip: from the MMA warps themselves, no epilogue). Combined output:
 *      each (token, column tile) counts arrivals and the last arriving CTA sums the slots
 *      in slot order.
 *   No step cleans up: flags and counters in scratch are compared with the call's number
 *   (SyncWords), so a CTA leaves as soon as its warps are done, and any layer that
 *   shares the scratch can run next.
 * Shape limits: H % 64 == 0, I % 32 == 0, 1 <= K <= 32, E <= 4096, <= 64 tokens and
 * <= 1024 pairs per launch (the host splits larger batches into several launches).
 */
#include <cuda_bf16.h>

#include "kimi_kernels.h"
#include "marks.cuh"
#include "moe_layout.cuh"
#include "mx.cuh"
#include "pipeline.cuh"
#include "route.cuh"

namespace kx {
namespace {

/* ---- constants ---------------------------------------------------------------- */
/* warp roles: 16 MMA (consumer) warps, a weight producer, two activation producers and
 * 5 epilogue warps (tagged launches of several tokens: four and three, see Roles), so
 * neither copies nor epilogues ever wait behind each other. The MMA
 * warps bound the speed (at B = 8 they waited for data 22 % of the call with 8 of them,
 * the weight producer for free stages half of it); 16 hide their shared-memory and MMA
 * latencies better (-4.5 % at B = 8; 80 registers, no spills since v24, which loads the
 * finisher's row max |h| with its h). Their partial sums then take twice the reduction
 * work, and a fifth epilogue warp gives back what the MMA warps waited for a free slot
 * (-3.4 % at B = 64). One activation producer's per-chunk
 * latency (a unit's rows, one bulk copy per row issued lane after lane) was on the
 * critical path: 200 idle cycles per chunk cost 17 % at B = 8; a second one, taking
 * every other tile, gave -9 % at B = 8 and -12 % at B = 64 (a third, with one epilogue
 * warp fewer, less; a 25th warp would cut the registers to 72). */
constexpr int kConsumerWarpsLog2 = 4;
constexpr int kConsumerWarps = 1 << kConsumerWarpsLog2;
constexpr int kConsumerThreads = kConsumerWarps * 32;
constexpr int kWeightWarp = kConsumerWarps;
constexpr int kActivationWarp = kWeightWarp + 1;
constexpr int kSideWarps = 7; /* after the weight producer: the activation producers, then the epilogue warps */
constexpr int kThreads = (kActivationWarp + kSideWarps) * 32;
constexpr int kMaxActivationWarps = 4, kMaxEpilogueWarps = 5; /* over the kinds of launch (Roles) */
constexpr int kUnitsPerWarp = kUnitsPerChunk / kConsumerWarps;
constexpr int kStages = 4; /* 4 x 17 KB of weights in flight per SM already streams at 4.4 TB/s */

/* The side warps' roles by kind of launch. Activation producers take the CTA's tiles in turn,
 * a tagged launch's FC2 chunks in turn (each stage always one warp's). A tagged launch of
 * several tokens polls and widens its FC2 chunks' words on four of them, one per stage, and
 * keeps three epilogue warps: -1.9 % at k3-tp8 B = 2, -5.5 % at TP16 (session 39); wide
 * launches lost 1.5-14 % with three epilogue warps, one-token launches gained nothing. */
template <bool kLocalX, bool kTagged>
struct Roles {
  static constexpr int kActivationWarps = kTagged && !kLocalX ? 4 : 2;
  static constexpr int kEpilogueWarps = kSideWarps - kActivationWarps;
  static constexpr int kFirstEpilogueWarp = kActivationWarp + kActivationWarps;
  static_assert(kStages % kActivationWarps == 0, "tagged FC2 chunks go round the warps: each stage stays one warp's");
  static_assert(kActivationWarps <= kMaxActivationWarps && kEpilogueWarps <= kMaxEpilogueWarps, "shared memory");
};
constexpr int kActBlockBytes = kMxBlock * 2;          /* activations travel as f16 */
/* Activation rows in a stage, chunk_kb k-blocks each: the row pitch is a multiple of 128
 * bytes plus 64 of padding, so the 8 rows' 16-byte fragment loads hit all banks. */
constexpr int kActRowPad = 64;
KX_HOST_DEVICE constexpr int act_row_values(int chunk_kb) { return (chunk_kb * kActBlockBytes + 127) / 128 * 128; }
KX_HOST_DEVICE constexpr int act_row_bytes(int chunk_kb) { return act_row_values(chunk_kb) + kActRowPad; }
constexpr int kActRowBytes = act_row_bytes(kMaxChunkKb); /* FC1's x rows: room for any chunk */
constexpr int kStageWeightBytes = kChunkMaxBytes;
constexpr int kStageActBytes = kGroupTokens * kActRowBytes;
/* a stage: weights, then activation rows */
constexpr int kStageActOffset = kStageWeightBytes;
constexpr int kStageBytes = kStageActOffset + kStageActBytes;
constexpr int kMinTileCols = 4 * kStripRows; /* FC2 tiles are 64, 128 or 256 output columns */
/* Launches of a few tokens keep x in every CTA's shared memory, where the MMA warps read
 * it (local x): no grid-wide wait for x and no copies of it. A row holds all of x's
 * f16 blocks, pitched like a stage's activation row. */
constexpr int kLocalXMaxTokens = 1; /* at B = 2 local x was 5 % slower (session 14) */
constexpr int kSmemBudget = 227 * 1024; /* sm_90's opt-in shared memory per block */
KX_HOST_DEVICE constexpr int local_x_pitch(int hidden) { return act_row_bytes(hidden / kMxBlock); }
/* A shorter last chunk's uncounted units are loaded too (consume_units), up to a chunk past
 * the last x row: at H = 4224 (132 k-blocks, then in 28-block chunks: 4 x 27 + 24) 64 bytes
 * past the end of shared memory without this room. */
constexpr int kLocalXOverread = kMaxChunkKb * kActBlockBytes;
constexpr int kConsumerBarrier = 1;
constexpr int kRoutedBarrier = 3; /* the routing warps arrive, the MMA warps wait (2 is route.cuh's) */
constexpr uint16_t kBf16Nan = 0x7FC0;
static_assert(kThreads - kConsumerThreads == kRouteThreads, "the warps that are not MMA warps route");
static_assert(kStageBytes % 128 == 0 && kActRowBytes % 16 == 0, "copy destinations stay aligned");
static_assert(kUnitsPerChunk % kConsumerWarps == 0, "every warp gets the same units per stage");
static_assert(kGroupTokens == 8, "a unit's tokens are one MMA n-tile");
static_assert(kUnitsPerWarp == 4, "consume_phase dispatches 0..4 units per warp and chunk");

/* FC2's hidden rows travel in unit blocks: chunk c of hidden row r sits at block row
 * c * hidden_rows + r, so the rows of a unit for one chunk are one contiguous copy (one
 * per row before, which kept the activation producer issuing copies for half the call at
 * B = 64). A block row is laid out as a stage's activation row of that chunk. FC1's x rows
 * stay per token. */
KX_HOST_DEVICE int block_row_bytes(const PhaseShape &ph) { return act_row_bytes(ph.chunk_kb); }
/* Block-scaled hidden rows ("tagged" launches): each FC1 tile (32 hidden columns: one MX block
 * per token) quantizes its own blocks, so no hidden row waits for the unit's other tiles before
 * its quantization, and hands them to FC2 as tagged words (below) instead of through h, hq and
 * the unit's counter, finisher and flag. FC2's activation producer folds a chunk's block scales
 * into each row's f16 codes relative to that row's largest in the chunk (as x's are to the
 * row's, quantize_store) and leaves the row's chunk multiplier, an fp32 power of two, at this
 * offset + 4 * row in the padding of the stage's first activation row; the MMA warps apply
 * them once per chunk, not per unit. */
KX_HOST_DEVICE int chunk_scale_offset(const PhaseShape &ph) { return act_row_values(ph.chunk_kb); }
static_assert(kActRowPad >= 4 * kGroupTokens, "a chunk's multipliers, one per row, fit a block row's padding");
/* Which launches are tagged: those whose FC1 takes at most kTaggedFc1Rounds rounds of the
 * grid (tokens x K units of fc1.tiles tiles at most; one token has local x too). A unit's
 * finisher (a fence, an atomic, a sequentially consistent fence, the rows' loads and
 * quantization, then the flag) takes 3-7 us from the unit's last FC1 tile to its release
 * (session 38), on the critical path where FC1 takes few rounds: tagged, B = 2 is -11 % at
 * k3-tp8 and -9 % at TP16 (2.9 rounds each), TP16's B = 3 / 4 -6 % (2.2 / 2.9 rounds, with
 * four gatherers, Roles). With more rounds the finishers hide behind FC2 tiles, and the FC2
 * gathers (each chunk's words loaded, checked, widened and stored by a warp, where a copy is
 * one instruction) cost more: k3-tp8 B = 3 (4.4 rounds) +1.4 %, B = 8 +4 %, TP16 B = 8 +6 %. */
constexpr int kTaggedFc1Rounds = 3;

/* Tagged hand-off words: block kb of hidden row r is 16 words at (r * I / 32 + kb) * 16,
 * word w = e4m3 codes of elements 2w, 2w + 1 | the block's E8M0 scale << 16 | call << 24
 * (the call number's low 40 bits). A 64-bit store is single-copy atomic, so a reader that
 * sees its own call's tag in a word has that word's data: the FC1 epilogue only stores, with
 * no fence, counter or flag, and FC2's activation producer polls the words themselves (at
 * B = 1 the fence, atomic and release of the last tile, the flag's poll and the copy of hq
 * were ~4 round trips through L2 between FC1's last MMA and FC2's first). Tags repeat only
 * 2^40 calls apart. The words sit at the same offset for every shape (scratch_layout), so
 * no other shape's data can ever be read there as a tag. */
constexpr int kHandoffWordsPerBlock = kMxBlock / 2;
constexpr int kHandoffScaleShift = 16;
constexpr int kHandoffTagShift = 24;
constexpr int kHandoffBlocks = 4096; /* hidden rows (<= tokens x K) x I / 32 of a tagged launch */
KX_HOST_DEVICE bool handoff_fits(const kx_moe_shape &s, int tokens) {
  return (int64_t)tokens * s.top_k * (s.inter / kMxBlock) <= kHandoffBlocks;
}

/* ---- scratch (global) layout: one place, used by host and device ---------------- */
constexpr int kMaxGrid = 1024;
constexpr int kMaxUnits = max_units_for(kMaxPairs);

/* The CTAs' hand-offs through scratch. Nothing here is reset between calls (a last CTA
 * out cleaning up held every call's end back by ~2 kcycles of fence and atomic): a call
 * knows its number, since every CTA counts its own calls and every call runs every CTA of
 * the same grid, and flags hold the number of the call that set them. Layers of any
 * shape share one scratch, so this sits first, the same for every shape. */
struct SyncWords {
  unsigned long long fault;                 /* ~((pair << 32) | id) of the first bad id, 0 = none */
  unsigned int xq_ready;                    /* += 1 per CTA done quantizing x: call n's x is in at n * grid */
  unsigned long long calls[kMaxGrid];       /* calls run by CTA i */
  unsigned long long unit_ready[kMaxUnits]; /* the call that released unit u's hidden rows */
  unsigned int fc1_done[kMaxUnits];         /* unit u's FC1 tiles done, back to 0 at its last */
  unsigned int h_amax[kMaxPairs];           /* max |h| of hidden row r (float bits), 0 between calls */
};

struct ScratchLayout {
  int64_t sync, handoff, combine_count, xq, x_mult, h, hq, h_mult, y, total;
};

KX_HOST_DEVICE int64_t align128(int64_t v) { return (v + 127) & ~(int64_t)127; }

/* (token, slot) pairs of a launch of launch_tokens tokens: the rows of h and of the unit
 * blocks, and what the routing tables are sized for. */
KX_HOST_DEVICE int launch_pairs(const kx_moe_shape &s, int launch_tokens) { return launch_tokens * s.top_k; }

KX_HOST_DEVICE ScratchLayout scratch_layout(const kx_moe_shape &s, int launch_tokens) {
  const int pairs = launch_pairs(s, launch_tokens);
  const PhaseShape fc2 = fc2_shape(s.experts, s.hidden, s.inter);
  ScratchLayout L;
  int64_t at = 0;
  L.sync = at; at = align128(at + sizeof(SyncWords));
  L.handoff = at; at = align128(at + 8 * (int64_t)kHandoffBlocks * kHandoffWordsPerBlock); /* every shape's */
  L.combine_count = at; at = align128(at + 4 * (int64_t)launch_tokens * (s.hidden / kMinTileCols));
  L.xq = at; at = align128(at + 2 * (int64_t)launch_tokens * s.hidden);
  L.x_mult = at; at = align128(at + 4 * (int64_t)launch_tokens);
  L.h = at; at = align128(at + 4 * (int64_t)pairs * s.inter);
  L.hq = at; at = align128(at + (int64_t)fc2.n_chunks * pairs * block_row_bytes(fc2));
  L.h_mult = at; at = align128(at + 4 * (int64_t)pairs);
  L.y = at; at = align128(at + 2 * (int64_t)pairs * s.hidden);
  L.total = at;
  return L;
}

/* ---- shared memory layout ------------------------------------------------------- */
struct SmemLayout {
  int ring, full, empty, parked, freed, reduce, call, released, act_rows, x_amax;
  int pair_expert, expert_slot, token_mask, expert_id, expert_scan;
  int unit_expert, unit_group, token_experts, token_bad, chunk_mask, scan_tmp, totals, unit_pairs;
  int x_local_mult, x_local, x_local_rows; /* local x: room for launches of up to x_local_rows tokens */
  int bytes;
};

/* A reduction slot holds every MMA warp's partial sums as [warp][token][row]: the FC2
 * epilogue reads 4 consecutive rows of a token with one 16-byte load (as [row][token]
 * its lanes, 4 rows apart, all hit one bank: 32-way conflicts), and the FC1 epilogue's
 * lanes read consecutive words. A warp's block is padded by 16 floats, so the two
 * warps a quarter of the FC2 epilogue's lanes read lie 16 banks apart. */
constexpr int kReducePitch = kGroupTokens * kStripRows + 16;
constexpr int kReduceFloats = kConsumerWarps * kReducePitch;
static_assert(kReducePitch % 4 == 0 && kStripRows % 4 == 0, "reduced4 reads 16-byte aligned rows");

KX_HOST_DEVICE SmemLayout smem_layout(int experts, int pairs, int hidden) {
  SmemLayout L;
  int at = 0;
  auto take = [&at](int bytes, int align) { at = (at + align - 1) / align * align; int o = at; at += bytes; return o; };
  L.ring = take(kStages * kStageBytes, 128);
  L.full = take(8 * kStages, 8);
  L.empty = take(8 * kStages, 8);
  L.parked = take(8 * kMaxEpilogueWarps, 8);
  L.freed = take(8 * kMaxEpilogueWarps, 8);
  L.reduce = take(4 * kReduceFloats * kMaxEpilogueWarps, 16);
  L.call = take(8, 8);
  L.released = take(4, 4);
  L.act_rows = take(4 * kGroupTokens * kMaxActivationWarps, 4);
  L.x_amax = take(4 * kMaxLaunchTokens, 4);
  L.token_mask = take(8 * pairs, 8);
  L.expert_slot = take(4 * experts, 4);
  L.expert_scan = take(4 * pairs, 4);
  L.token_experts = take(4 * kMaxLaunchTokens, 4);
  L.token_bad = take(4 * kMaxLaunchTokens, 4);
  L.chunk_mask = take(4 * 32, 4);
  L.scan_tmp = take(4 * 32, 4);
  L.totals = take(4 * 4, 4);
  L.unit_pairs = take(4 * 32, 4); /* one-warp routing: at most 32 units */
  L.pair_expert = take(2 * pairs, 2);
  L.expert_id = take(2 * pairs, 2);
  L.unit_expert = take(2 * max_units_for(pairs), 2);
  L.unit_group = take(max_units_for(pairs), 1);
  /* local x takes what the budget has left (the L1 carve-out is 228 KB either way) */
  L.x_local_mult = take(4 * kLocalXMaxTokens, 4);
  const int x_at = (int)align128(at), fit = (kSmemBudget - x_at - kLocalXOverread) / local_x_pitch(hidden);
  L.x_local_rows = fit < 0 ? 0 : (fit > kLocalXMaxTokens ? kLocalXMaxTokens : fit);
  L.x_local = take(L.x_local_rows * local_x_pitch(hidden) + (L.x_local_rows ? kLocalXOverread : 0), 128);
  L.bytes = (int)align128(at);
  return L;
}

/* ---- kernel parameters ---------------------------------------------------------- */
struct Params {
  kx_moe_shape shape;
  PhaseShape fc1, fc2;
  SmemLayout smem;
  const uint8_t *packed;
  const __nv_bfloat16 *x;   /* row tok0 */
  int64_t x_ld;
  const int32_t *ids;       /* row tok0 */
  int64_t ids_ld;
  const float *route_weights; /* row tok0, or NULL */
  int64_t rw_ld;
  __nv_bfloat16 *out;       /* row 0 of the caller's output */
  int64_t out_ld;
  int tok0, tokens;
  float beta, linear_beta;
  bool hidden_floor;
  SyncWords *sync;
  int *combine_count;
  uint8_t *xq; /* f16 values in fragment order (quantize_store) */
  float *x_mult; /* per x row: 2^(R + 14), R its reference exponent (mx.cuh) */
  float *h;
  uint8_t *hq; /* likewise, in unit blocks (block_row_bytes) */
  int hidden_rows; /* rows of h per launch: block row c * hidden_rows + r */
  float *h_mult;   /* per hidden row: 2^(R + 14) */
  unsigned long long *handoff; /* tagged launches' hidden blocks as tagged words */
  __nv_bfloat16 *y;
};

/* Whether FC2's rows go out from the MMA warps (store_token_rows) instead of an epilogue
 * warp: one-token launches (tagged, block-scaled hidden rows) with one MMA warp per FC2 strip, so
 * there are no partial sums to add, and no combine (its counters are the epilogue warps').
 * The hop through an epilogue warp is the call's last step there (session 28: -2.3 % at
 * B = 1 without it). */
__device__ __forceinline__ bool fc2_rows_by_mma_warps(const Params &p, bool one_token) {
  return one_token && p.fc2.strips == kConsumerWarps && p.route_weights == nullptr;
}

/* Block row of chunk c of hidden row `row` (the unit-block layout above). */
__device__ __forceinline__ int64_t hidden_block_row(const Params &p, int c, int row) {
  return (int64_t)c * p.hidden_rows + row;
}

/* ---- small device helpers --------------------------------------------------------- */
/* d += A (16x16 f16, 4 registers) x B (16x8 f16, 2 registers), fp32 accumulate. */
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9},"
      " {%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* Four bf16 to dst: one 8-byte store when aligned (it is for the usual strides). */
__device__ __forceinline__ void store_bf16x4(__nv_bfloat16 *dst, const float (&v)[4]) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]), hi = __floats2bfloat162_rn(v[2], v[3]);
  if (((uintptr_t)dst & 7) == 0) {
    uint2 w;
    w.x = *reinterpret_cast<uint32_t *>(&lo);
    w.y = *reinterpret_cast<uint32_t *>(&hi);
    *reinterpret_cast<uint2 *>(dst) = w;
  } else {
    dst[0] = lo.x; dst[1] = lo.y; dst[2] = hi.x; dst[3] = hi.y;
  }
}

/* Two e4m3 codes times rel as an f16 pair, rounded once (exact inside the window of
 * act_reference_exponent): for a factor per pair, where folded_f16x2's two factors cost more
 * (with them the one-token hand-off's widening made B = 1 +1.1 %, session 35). */
__device__ __forceinline__ uint32_t scaled_f16x2(uint32_t two_codes, float rel) {
  const uint32_t codes = e4m3x2_to_f16x2(two_codes);
  const float2 f = __half22float2(*reinterpret_cast<const __half2 *>(&codes));
  const __half2 out = __float22half2_rn(make_float2(f.x * rel, f.y * rel));
  return *reinterpret_cast<const uint32_t *>(&out);
}

/* 16 f16x2 words, pair k holding elements 2k and 2k + 1 (folded_f16x2), stored in MMA fragment
 * order (64 bytes, 16-byte aligned): lane t of a quad reads k = 2t, 2t+1, 2t+8, 2t+9, 2t+16, 2t+17,
 * 2t+24, 2t+25 (its B registers of both m16n8k16) as one 16-byte load from offset 16t. */
__device__ __forceinline__ void store_fragment_block(const uint32_t (&pairs)[kMxBlock / 2], uint8_t *dst) {
  uint4 *d = reinterpret_cast<uint4 *>(dst);
#pragma unroll
  for (int t = 0; t < 4; ++t) d[t] = make_uint4(pairs[t], pairs[t + 4], pairs[t + 8], pairs[t + 12]);
}

/* Quantizes one block of 32 fp32 to MXFP8 and stores it for the MMAs: the 32 codes times
 * 2^(e - ref_exp) as f16 (store_fragment_block). A NaN block's codes are NaN. */
__device__ __forceinline__ void quantize_store(const float (&v)[kMxBlock], bool floor_mode, int ref_exp,
                                               uint8_t *dst) {
  uint32_t q[kMxBlock / 4];
  const FoldF16 fold = fold_f16((int)quantize_block32(v, floor_mode, q) - kE8m0Bias, ref_exp);
  uint32_t pairs[kMxBlock / 2];
#pragma unroll
  for (int k = 0; k < kMxBlock / 2; ++k) pairs[k] = folded_f16x2(q[k / 2] >> 16 * (k % 2), fold);
  store_fragment_block(pairs, dst);
}

/* A block of x: its 32 bf16 as 16 words (element 2k in word k's low half) and the largest of
 * their |x| bits as fp32 bits (bf16 bits order like |x|, with Inf and then NaN above all). */
struct XBlock {
  uint32_t words[kMxBlock / 2];
  uint32_t amax_bits;
};

__device__ __forceinline__ XBlock load_x_block(const __nv_bfloat16 *src) {
  XBlock b;
  if (((uintptr_t)src & 15) == 0) {
#pragma unroll
    for (int i = 0; i < kMxBlock / 8; ++i) {
      const uint4 w = *reinterpret_cast<const uint4 *>(src + 8 * i);
      b.words[4 * i] = w.x; b.words[4 * i + 1] = w.y; b.words[4 * i + 2] = w.z; b.words[4 * i + 3] = w.w;
    }
  } else {
    const uint16_t *h = reinterpret_cast<const uint16_t *>(src);
#pragma unroll
    for (int k = 0; k < kMxBlock / 2; ++k) b.words[k] = h[2 * k] | (uint32_t)h[2 * k + 1] << 16;
  }
  uint32_t m = 0; /* both halves' max at once, on the bits without their signs */
#pragma unroll
  for (int k = 0; k < kMxBlock / 2; ++k) m = __vmaxu2(m, b.words[k] & 0x7FFF7FFFu);
  b.amax_bits = max(m & 0xFFFFu, m >> 16) << 16;
  return b;
}

/* quantize_store of an x block (rceil), bit for bit, on its bf16 pairs: no 32 floats, no
 * second max and one f16 product per pair instead of two conversions and two fp32 products
 * (B = 1's MMA warps had x ~0.85 kcycle sooner, session 35). */
__device__ __forceinline__ void quantize_store_x(const XBlock &b, int ref_exp, uint8_t *dst) {
  const bool finite = b.amax_bits < 0x7F800000u;
  const int e = finite ? mxfp8_exponent(__uint_as_float(b.amax_bits), false) : kE8m0Nan - kE8m0Bias;
  const float mul = finite ? exp2_exact(-e) : __uint_as_float(0x7FFFFFFFu); /* NaN: every code NaN */
  const FoldF16 fold = fold_f16(e, ref_exp);
  uint32_t pairs[kMxBlock / 2];
#pragma unroll
  for (int k = 0; k < kMxBlock / 2; ++k) {
    const uint32_t w = b.words[k];
    const float lo = __uint_as_float(w << 16) * mul, hi = __uint_as_float(w & 0xFFFF0000u) * mul;
    pairs[k] = folded_f16x2(__nv_cvt_float2_to_fp8x2(make_float2(lo, hi), __NV_SATFINITE, __NV_E4M3), fold);
  }
  store_fragment_block(pairs, dst);
}

/* The same block spread over a warp, lane k holding element k: returns its e4m3 code and
 * sets *scale to the block's E8M0 byte, bit for bit quantize_block32's. */
__device__ __forceinline__ uint32_t quantize_lanes(float v, bool floor_mode, uint32_t *scale) {
  /* |v| bits order like |v|; Inf and NaN above all. One warp reduction, not five shuffles: on
   * the one-token hand-off's path, where each shuffle queues behind the MMA warps' shared loads */
  const uint32_t m = __reduce_max_sync(0xFFFFFFFFu, __float_as_uint(v) & 0x7FFFFFFFu);
  const bool finite = m < 0x7F800000u;
  const int e = finite ? mxfp8_exponent(__uint_as_float(m), floor_mode) : 0;
  *scale = finite ? (uint32_t)(e + kE8m0Bias) : kE8m0Nan;
  return finite ? __nv_cvt_float_to_fp8(v * exp2_exact(-e), __NV_SATFINITE, __NV_E4M3) : 0x7Fu;
}

/* Word w of a block of tagged hand-off words (kHandoffTagShift) lands in the stage as
 * quantize_store's 32-bit word (w % 4) * 4 + w / 4 (elements 2w, 2w + 1 sit in lane quad
 * w % 4's 16 bytes, word w / 4). */
__device__ __forceinline__ int handoff_fragment_word(int w) { return (w % 4) * 4 + w / 4; }

/* The block's biased E8M0 scale in a tagged hand-off word. */
__device__ __forceinline__ uint32_t handoff_scale(unsigned long long word) {
  return (uint32_t)(word >> kHandoffScaleShift) & 0xFFu;
}

/* The warp's block (lane k: element k) quantized and stored as tagged words. */
__device__ __forceinline__ void store_handoff_block(unsigned long long *words, float v, bool floor_mode,
                                                    unsigned long long call) {
  const int lane = threadIdx.x & 31;
  uint32_t scale;
  const uint32_t code = quantize_lanes(v, floor_mode, &scale);
  const uint32_t next = __shfl_down_sync(0xFFFFFFFFu, code, 1);
  if (!(lane & 1))
    store_relaxed(words + lane / 2, call << kHandoffTagShift | scale << kHandoffScaleShift | next << 8 | code);
}

/* Shared-memory loads issued in program order (volatile), so a warp's units arrive one
 * after the other and the first unit's MMAs start while the rest are in flight; the
 * compiler would otherwise group them by type and the first MMA would wait for all. */
__device__ __forceinline__ uint2 lds64(uint32_t addr) {
  uint2 v;
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
  return v;
}

__device__ __forceinline__ void sts32(uint32_t addr, uint32_t v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
}

__device__ __forceinline__ uint32_t lds16(uint32_t addr) {
  uint16_t v;
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ float lds32f(uint32_t addr) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  return v;
}

__device__ __forceinline__ float2 lds64f(uint32_t addr) {
  const uint2 v = lds64(addr);
  return make_float2(__uint_as_float(v.x), __uint_as_float(v.y));
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}

struct Stage {
  uint8_t *weights, *act;
};

__device__ __forceinline__ Stage stage_at(uint8_t *smem, const SmemLayout &L, int s) {
  uint8_t *base = smem + L.ring + s * kStageBytes;
  return Stage{base, base + kStageActOffset};
}

/* Which phase, unit and tile a global tile index names. */
struct TileRef {
  bool fc1;
  int unit, tile;
};

__device__ __forceinline__ TileRef tile_ref(const Params &p, int index, int fc1_tiles) {
  const bool fc1 = index < fc1_tiles;
  const int i = fc1 ? index : index - fc1_tiles;
  const PhaseShape &ph = fc1 ? p.fc1 : p.fc2;
  const int unit = ph.per_tiles(i);
  return TileRef{fc1, unit, i - unit * ph.tiles};
}

/* ---- producers: the copy streams ------------------------------------------------------ */
/* Weights never wait for data: this warp only waits for free stages, so the weight
 * stream runs ahead across phase and unit boundaries. Lane 0 issues; the warp stays
 * converged. */
__device__ void produce_weights(const Params &p, uint8_t *smem, const Routing &r, int total_tiles, int fc1_tiles) {
  uint64_t *full = reinterpret_cast<uint64_t *>(smem + p.smem.full);
  uint64_t *empty = reinterpret_cast<uint64_t *>(smem + p.smem.empty);
  const uint64_t policy = l2_evict_first_policy();
  RingPos pos;
  KX_MARK_BY_IF((threadIdx.x & 31) == 0, kMarkWeightsEnter);
  for (int index = blockIdx.x; index < total_tiles; index += gridDim.x) {
    const TileRef ref = tile_ref(p, index, fc1_tiles);
    const PhaseShape &ph = ref.fc1 ? p.fc1 : p.fc2;
    const int expert = r.expert_id[r.unit_expert[ref.unit]];
    KX_MARK_BY_IF((threadIdx.x & 31) == 0 && index == (int)blockIdx.x && expert >= 0, kMarkWeightsLooked);
    for (int c = 0; c < ph.chunks(); ++c, pos.advance(kStages)) {
      const int s = pos.stage;
      mbar_wait(&empty[s], pos.parity ^ 1);
      if ((threadIdx.x & 31) == 0) {
        mbar_arrive_expect_tx(&full[s], ph.chunk_bytes(c));
        bulk_copy_streaming(stage_at(smem, p.smem, s).weights, p.packed + ph.chunk_offset(expert, ref.tile, c),
                            ph.chunk_bytes(c), &full[s], policy);
        KX_MARK_BY_IF(c == 0 && index == (int)blockIdx.x, kMarkFirstCopy);
        KX_MARK_BY_IF(c == 0 && !ref.fc1 && index - (int)gridDim.x < fc1_tiles, kMarkFirstFc2Copy);
      }
      __syncwarp();
    }
  }
}

/* FC1's activation rows of a unit for one chunk: lane i copies row i, one copy-engine copy
 * (16-byte cp.async pieces kept this warp issuing for most of the call: ~1.4 kcycles a
 * stage at B = 8). */
__device__ __forceinline__ void copy_activations(const Stage &st, uint64_t *full, const uint8_t *q_src,
                                                 int64_t q_row_stride, const int *rows, int count, int row_bytes) {
  const int lane = threadIdx.x & 31;
  if (lane == 0) mbar_arrive_expect_tx(full, (uint32_t)count * (uint32_t)row_bytes);
  __syncwarp(); /* the bytes are expected before any can land */
  if (lane < count)
    bulk_copy(st.act + lane * kActRowBytes, q_src + rows[lane] * q_row_stride, (uint32_t)row_bytes, full);
}

/* A unit's hidden rows for FC2 chunk c: one copy (unit blocks). */
__device__ __forceinline__ void copy_hidden_block(const Params &p, const Stage &st, uint64_t *full, const Unit &unit,
                                                  int c) {
  const int64_t block_row = hidden_block_row(p, c, unit.row0);
  const uint32_t bytes = (uint32_t)unit.count * block_row_bytes(p.fc2);
  if ((threadIdx.x & 31) == 0) {
    mbar_arrive_expect_tx(full, bytes);
    bulk_copy(st.act, p.hq + block_row * block_row_bytes(p.fc2), bytes, full);
  }
  __syncwarp();
}

/* One hidden row's tagged words for FC2 chunk c: lane l holds words l, l + 32, ... */
constexpr int kHiddenWordsPerLane = kMaxChunkKb * kHandoffWordsPerBlock / 32;
struct HiddenWords {
  unsigned long long w[kHiddenWordsPerLane];
};

/* Loads (polls once) hidden row `row`'s words of FC2 chunk c; their tags are checked at use, so
 * the loads stay in flight until then. */
__device__ __forceinline__ void load_hidden_words(const Params &p, int row, int c, HiddenWords &h) {
  const int lane = threadIdx.x & 31, words = p.fc2.chunk_k_blocks(c) * kHandoffWordsPerBlock;
  const unsigned long long *src =
      p.handoff + ((int64_t)row * p.fc2.k_blocks + c * p.fc2.chunk_kb) * kHandoffWordsPerBlock;
#pragma unroll
  for (int k = 0; k < kHiddenWordsPerLane; ++k) {
    const int j = lane + 32 * k;
    if (j >= words) break;
    h.w[k] = load_relaxed(src + j);
  }
}

/* A unit's hidden blocks for FC2 chunk c from their tagged words, row by row (the first row's
 * already loaded into `first`): polled until every word carries this call's tag, then widened
 * to f16 in the stage as quantize_store lays them out, each block's codes times
 * 2^(its scale - ref), ref = the row's largest scale in the chunk - 7 (exact within 22 binades
 * of the largest), and 2^(ref - 127) left at chunk_scale_offset + 4 * row. A NaN block's codes
 * are NaN, so its sums stay NaN. Returns how many polls it took (the marks count them). */
template <int kActivationWarps>
__device__ __forceinline__ int gather_hidden_blocks(const Params &p, const Stage &st, uint64_t *full, const Unit &unit,
                                                    int c, unsigned long long call, HiddenWords &first) {
  const int lane = threadIdx.x & 31, words = p.fc2.chunk_k_blocks(c) * kHandoffWordsPerBlock;
  const unsigned long long tag = call << kHandoffTagShift;
  int polls = 0; /* for the marks */
  for (int i = 0; i < unit.count; ++i) {
    HiddenWords &h = first; /* the first row's words, then each next row's in the same registers */
    if (i > 0) load_hidden_words(p, unit.row0 + i, c, h);
    for (;;) {
      ++polls;
      bool mine = true;
#pragma unroll
      for (int k = 0; k < kHiddenWordsPerLane; ++k) {
        if (lane + 32 * k >= words) break;
        mine &= (h.w[k] & ~((1ull << kHandoffTagShift) - 1)) == tag;
      }
      if (__all_sync(0xFFFFFFFFu, mine)) break;
      load_hidden_words(p, unit.row0 + i, c, h);
    }
    uint32_t top = 0;
#pragma unroll
    for (int k = 0; k < kHiddenWordsPerLane; ++k) {
      if (lane + 32 * k >= words) break;
      top = max(top, handoff_scale(h.w[k]));
    }
    const int ref = max((int)__reduce_max_sync(0xFFFFFFFFu, top) - kFoldHeadroomLog2, 0);
    uint8_t *row = st.act + i * block_row_bytes(p.fc2);
#pragma unroll
    for (int k = 0; k < kHiddenWordsPerLane; ++k) {
      const int j = lane + 32 * k, kb = j / kHandoffWordsPerBlock, wi = j % kHandoffWordsPerBlock;
      if (j >= words) break;
      const float rel = fold_factor((int)handoff_scale(h.w[k]), ref); /* both biased */
      reinterpret_cast<uint32_t *>(row + kb * kActBlockBytes)[handoff_fragment_word(wi)] =
          scaled_f16x2((uint32_t)h.w[k] & 0xFFFFu, rel);
    }
    if (lane == 0) reinterpret_cast<float *>(st.act + chunk_scale_offset(p.fc2))[i] = exp2_exact(ref - kE8m0Bias);
  }
  __syncwarp(); /* the lanes' stores before lane 0's arrive, a release */
  if (lane == 0) mbar_arrive(full, kActivationWarps); /* the other warps' arrivals too (produce_activations) */
  return polls;
}

/* Whether the units of this CTA's next 32 tiles have their hidden rows: one round trip
 * for 32 flags (a flag read costs about a microsecond, as long as an FC2 tile's copy). */
__device__ __forceinline__ uint32_t poll_units(const Params &p, int index, int total_tiles, int fc1_tiles,
                                               unsigned long long call) {
  const int lane = threadIdx.x & 31, ahead = index + lane * gridDim.x;
  bool ready = true;
  if (ahead < total_tiles) {
    const TileRef ref = tile_ref(p, ahead, fc1_tiles);
    ready = ref.fc1 || load_acquire(&p.sync->unit_ready[ref.unit]) == call;
  }
  const uint32_t mask = __ballot_sync(0xFFFFFFFFu, ready);
  fence_acq_rel_gpu(); /* what one lane acquired, every lane's copies may read */
  return mask;
}

/* Activations are written in this launch by other CTAs, so these warps wait for them:
 * x once, each unit's hidden rows before its first FC2 tile. Activation producer `which`
 * takes the CTA's tiles q with q % kActivationWarps == which, so one prepares and issues
 * its tile while the others' copies are in flight. */
template <bool kLocalX, bool kTagged>
__device__ void produce_activations(const Params &p, uint8_t *smem, const Routing &r, int total_tiles, int fc1_tiles,
                                    int which, unsigned long long call) {
  constexpr int kActivationWarps = Roles<kLocalX, kTagged>::kActivationWarps;
  uint64_t *full = reinterpret_cast<uint64_t *>(smem + p.smem.full);
  uint64_t *empty = reinterpret_cast<uint64_t *>(smem + p.smem.empty);
  int *rows = reinterpret_cast<int *>(smem + p.smem.act_rows) + which * kGroupTokens;
  const int lane = threadIdx.x & 31;
  bool x_ready = false;
  uint32_t known_ready = 0; /* bit i: this CTA's tile q_known + i has its activations */
  int q_known = 0;
  RingPos pos;
  int n = 0; /* chunks walked so far, the other warps' too */
  for (int index = blockIdx.x, q = 0; index < total_tiles; index += gridDim.x, ++q) {
    const TileRef ref = tile_ref(p, index, fc1_tiles);
    const PhaseShape &ph = ref.fc1 ? p.fc1 : p.fc2;
    const bool mine = q % kActivationWarps == which;
    /* a tagged FC2 tile's chunks go round the warps, so one's poll of the tagged words and
     * their widening overlap the others' */
    const bool by_chunk = !ref.fc1 && kTagged;
    Unit unit;
    if (mine || by_chunk) unit = unit_info(r, ref.unit);
    if (mine) {
      __syncwarp();
      if (ref.fc1 && lane < unit.count) rows[lane] = nth_set_bit(unit.mask, unit.first_rank + lane); /* x rows */
      if (ref.fc1 && !x_ready && !kLocalX) {
        wait_count(&p.sync->xq_ready, (unsigned int)call * gridDim.x);
        KX_MARK_BY_IF(lane == 0 && which == 0, kMarkXSeen);
        fence_proxy_async_global();
        x_ready = true;
      } else if (!ref.fc1 && !kTagged &&
                 (q - q_known >= 32 || !((known_ready >> (q - q_known)) & 1))) {
        q_known = q;
        known_ready = poll_units(p, index, total_tiles, fc1_tiles, call);
        if (!(known_ready & 1)) wait_equal(&p.sync->unit_ready[ref.unit], call);
        fence_proxy_async_global();
      }
      KX_MARK_TILE_NS_BY_IF(lane == 0 && !ref.fc1 && !kTagged, index, kMarkTileReady);
      __syncwarp();
    }
    /* Every stage in ring order, the other warps' too, and arrive on the ones it does not
     * fill: a parity wait is only right within one phase of the barrier. One that skipped
     * stages could run two laps ahead of the MMA warps; one that waited without arriving
     * could fall a phase behind them (they need only the owner's copy) and then wait for a
     * phase that needs its own next copy: with 1-chunk tiles (H = 64, E = 4096) that hung.
     * Tagged FC2 chunks are the exception: chunk n is warp n % kActivationWarps's, so each
     * stage is always the same warp's from there on, and its own waits keep it within a
     * phase; the others skip the chunk and the gatherer arrives for all (-0.5 % at B = 1,
     * session 39). */
    for (int c = 0; c < ph.chunks(); ++c, pos.advance(kStages), ++n) {
      if (by_chunk && n % kActivationWarps != which) continue;
      const int s = pos.stage;
      const Stage st = stage_at(smem, p.smem, s);
      /* a tagged chunk's first row's words: their round trip overlaps the wait for the stage */
      HiddenWords first;
      if (by_chunk) load_hidden_words(p, unit.row0, c, first);
      mbar_wait(&empty[s], pos.parity ^ 1);
      KX_MARK_BY_IF(lane == 0 && n == 0 && which < 2, kMarkActStage + which);
      if (!by_chunk && !mine) {
        if (lane == 0) mbar_arrive(&full[s]);
        continue;
      }
      KX_MARK_BY_IF(lane == 0 && c == 0 && !ref.fc1 && index - (int)gridDim.x < fc1_tiles, kMarkFc2ActStage);
      const int nkb = ph.chunk_k_blocks(c);
      if (ref.fc1 && kLocalX) {
        if (lane == 0) mbar_arrive(&full[s]); /* the MMA warps read x where it lies */
        __syncwarp();
      } else if (ref.fc1)
        copy_activations(st, &full[s], p.xq + c * ph.chunk_kb * kActBlockBytes, (int64_t)ph.k_blocks * kActBlockBytes,
                         rows, unit.count, nkb * kActBlockBytes);
      else if (kTagged) {
        KX_MARK_TILE_NS_BY_IF(lane == 0 && c < kMarkSeenChunks, index, kMarkTilePolled + c);
        const int polls = gather_hidden_blocks<kActivationWarps>(p, st, &full[s], unit, c, call, first);
        KX_MARK_TILE_NS_BY_IF(lane == 0 && c < kMarkSeenChunks, index, kMarkTileSeen + c);
        KX_MARK_TILE_VALUE_BY_IF(lane == 0 && c < kMarkSeenChunks, index, kMarkTilePolls + c, polls);
      } else {
        copy_hidden_block(p, st, &full[s], unit, c);
      }
      KX_MARK_BY_IF(lane == 0 && c == 0 && !ref.fc1 && index - (int)gridDim.x < fc1_tiles, kMarkFc2ActDone);
    }
  }
}

/* ---- consumers: decode + MMA over a phase's tiles -------------------------------------- */
/* Where one warp's first unit lies in a stage of chunks of nkb k-blocks, as byte offsets
 * from the stage; unit j is kStep k-blocks further, a compile-time offset. Activation rows
 * sit row_bytes apart (per phase: FC1's per-token rows, FC2's unit blocks). */
struct UnitOffsets {
  uint32_t weights, scales, act;
};

__device__ __forceinline__ UnitOffsets unit_offsets(int strips, int strip, int k_slot, int nkb, int row_bytes) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, first_unit = strip * nkb + k_slot;
  return UnitOffsets{(uint32_t)(first_unit * kUnitWeightBytes + lane * 8),
                     (uint32_t)(strips * nkb * kUnitWeightBytes + first_unit * kUnitScaleBytes + 2 * g),
                     (uint32_t)(kStageActOffset + g * row_bytes + k_slot * kActBlockBytes + 16 * t)};
}

/* Units of a chunk of nkb k-blocks for the warp at k_slot (warp-uniform); k-step 2^step_log2. */
__device__ __forceinline__ int units_in(int nkb, int k_slot, int step_log2) {
  return nkb > k_slot ? (nkb - k_slot + (1 << step_log2) - 1) >> step_log2 : 0;
}

/* One warp's kUnits units of the stage at shared address `stage` (its activations from
 * act_base: the stage, or local x's chunk): every shared-memory
 * load first (unit by unit), then decode + MMA with no branch between units, then the
 * stage is released. A warp without units only releases the stage. kPartial: a
 * tile's shorter last chunk, where only the first `units` count (the others read other
 * bytes of the same stage and are left out of the sums). kChunkScale: each MMA column's
 * chunk sums take its row's multiplier, which the activation producer left at chunk_scale
 * (block-scaled hidden rows). kOneToken: MMA column 0 (the launch's token) is the only one
 * read, so the others are not summed. */
template <int kUnits, int kStep, bool kChunkScale, bool kOneToken, bool kPartial = false>
__device__ __forceinline__ void consume_units(uint32_t stage, uint32_t act_base, const UnitOffsets &o,
                                              uint32_t chunk_scale_at, uint32_t released, uint64_t *empty,
                                              float (&acc)[4], int units = kUnits) {
  if constexpr (kUnits == 0) {
    mbar_arrive(empty);
  } else {
    const uint32_t weights = stage + o.weights, scales = stage + o.scales, act = act_base + o.act;
    uint2 w[kUnits];
    uint4 b[kUnits];
    uint32_t sw[kUnits];
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      w[j] = lds64(weights + j * kStep * kUnitWeightBytes);
      b[j] = lds128(act + j * kStep * kActBlockBytes);
      sw[j] = lds16(scales + j * kStep * kUnitScaleBytes);
    }
    /* columns 2t and 2t + 1 (t = lane % 4): their rows' chunk multipliers */
    const float2 chunk_scale = !kChunkScale ? make_float2(1.0f, 1.0f)
                               : kOneToken  ? make_float2(lds32f(act_base + chunk_scale_at), 0.0f)
                                            : lds64f(act_base + chunk_scale_at + 8 * (threadIdx.x & 3));
    float part[4] = {0.0f, 0.0f, 0.0f, 0.0f}; /* kChunkScale: this chunk's sums */
    float (&sums)[4] = kChunkScale ? part : acc;
#pragma unroll
    for (int j = 0; j < kUnits; ++j) {
      /* row g's byte lands on the exponent, row g+8's low bit on the sign, which the FFMAs
       * drop (|operand|): one shift, no mask */
      const float sw_g = fabsf(__uint_as_float(sw[j] << 23)), sw_g8 = e8m0_to_float_nonzero(sw[j] >> 8);
      uint32_t a_lo[4], a_hi[4];
      decode_fp4x8(w[j].x, a_lo);
      decode_fp4x8(w[j].y, a_hi);
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_f16(d, a_lo, b[j].x, b[j].y);
      mma_f16(d, a_hi, b[j].z, b[j].w);
      if (kPartial && j >= units) continue;
      sums[0] = fmaf(d[0], sw_g, sums[0]);
      sums[2] = fmaf(d[2], sw_g8, sums[2]);
      if constexpr (!kOneToken) { /* one token: column 0 alone is ever read */
        sums[1] = fmaf(d[1], sw_g, sums[1]);
        sums[3] = fmaf(d[3], sw_g8, sums[3]);
      }
    }
    /* every lane releases the stage once the values its loads read are in registers (no
     * warp-wide sync or divergent branch per stage, which cost ~6 of a stage's ~26
     * instructions of overhead). ptxas issues an arrive right behind the loads it follows,
     * without waiting for their data, and moves it above register math: released so, at
     * B = 64 with every token on the same 16 experts about one call in 1500 had one strip's
     * sums (warp 0's) wrong for 1-8 of the unit's tokens (session 44). So a store of a value
     * made from every loaded register (the sums take all weights, activations and scales)
     * comes first: it cannot issue before those loads are done, and the arrive, a release,
     * follows it (benchmarks/release_scan.py finds no ring load outstanding at a release). */
    const float held = kChunkScale ? chunk_scale.x : 0.0f;
    sts32(released, __float_as_uint(sums[0]) ^ __float_as_uint(held));
    mbar_arrive(empty);
    if constexpr (kChunkScale) /* powers of two: the same bits as the scales in the codes */
      for (int i = 0; i < 4; i += kOneToken ? 2 : 1)
        acc[i] = fmaf(part[i], i & 1 ? chunk_scale.y : chunk_scale.x, acc[i]);
  }
}

/* Parks this warp's partial sums as [warp][token][row] (kReducePitch) for the reduction. */
__device__ __forceinline__ void park_partials(float *reduce, const float (&acc)[4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  float *r = reduce + warp * kReducePitch;
  r[2 * t * kStripRows + g] = acc[0];
  r[(2 * t + 1) * kStripRows + g] = acc[1];
  r[2 * t * kStripRows + g + 8] = acc[2];
  r[(2 * t + 1) * kStripRows + g + 8] = acc[3];
}

/* What one MMA warp does in every tile of a phase, fixed once per phase: 16 warps over 2,
 * 4, 8 or 16 strips (shifts, no divisions), the units of its full chunks and of a shorter
 * last chunk (chunks are cut equal, moe_layout.cuh, so most shapes have none). */
struct ConsumerPlan {
  int k_step, units, full_chunks, last_units;
  bool short_last;
  UnitOffsets full, last;
  uint32_t chunk_scale; /* block-scaled hidden rows: where a stage holds the chunk's multiplier */
  uint32_t released;    /* a word the MMA warps store to before each release (consume_units) */
  uint32_t x_local, chunk_act_bytes; /* local x: its shared address, and how far a chunk's blocks move it */
  int fc1_tiles;                     /* the launch's FC1 tiles: FC2's tile indices start there (tile_ref) */
};

template <bool kLocalX>
__device__ __forceinline__ ConsumerPlan consumer_plan(const Params &p, uint8_t *smem, bool fc1, int fc1_tiles) {
  const PhaseShape &ph = fc1 ? p.fc1 : p.fc2;
  const int strips_log2 = __ffs(ph.strips) - 1, step_log2 = kConsumerWarpsLog2 - strips_log2;
  const int warp = threadIdx.x >> 5, strip = warp & (ph.strips - 1), k_slot = warp >> strips_log2;
  const int last_kb = ph.chunk_k_blocks(ph.chunks() - 1);
  ConsumerPlan cp;
  cp.k_step = 1 << step_log2;
  cp.units = units_in(ph.chunk_kb, k_slot, step_log2);
  cp.short_last = last_kb < ph.chunk_kb;
  cp.full_chunks = cp.short_last ? ph.chunks() - 1 : ph.chunks();
  cp.last_units = units_in(last_kb, k_slot, step_log2);
  const int row_bytes = fc1 ? kActRowBytes : block_row_bytes(ph);
  cp.full = unit_offsets(ph.strips, strip, k_slot, ph.chunk_kb, row_bytes);
  cp.last = unit_offsets(ph.strips, strip, k_slot, last_kb, row_bytes);
  cp.chunk_scale = kStageActOffset + (fc1 ? 0 : chunk_scale_offset(ph));
  cp.released = smem_addr(smem + p.smem.released);
  if (kLocalX && fc1) {
    /* B row g is launch token g (rows past the launch's read token 0's, and their columns
     * are never read): the MMA columns are the launch's tokens, whatever the unit */
    const int lane = threadIdx.x & 31, g = lane >> 2, row = g < p.tokens ? g : 0;
    cp.full.act = cp.last.act = row * local_x_pitch(p.shape.hidden) + k_slot * kActBlockBytes + 16 * (lane & 3);
  }
  cp.x_local = smem_addr(smem + p.smem.x_local);
  cp.chunk_act_bytes = ph.chunk_kb * kActBlockBytes;
  cp.fc1_tiles = fc1_tiles;
  return cp;
}

/* The ring as the MMA warps see it, handing sums to kEpilogueWarps warps in turn (Roles). */
template <int kEpilogueWarps_>
struct ConsumerRing {
  static constexpr int kEpilogueWarps = kEpilogueWarps_;
  uint32_t stages; /* shared address of stage 0 */
  uint64_t *full, *empty;
  RingPos pos;      /* the stage the MMA warps read next */
  RingPos epilogue; /* the epilogue warp (stage) that takes the next tile's sums */
};

/* Hands a tile's partial sums to the next epilogue warp in turn. */
template <class Ring>
__device__ __forceinline__ void hand_off(const Params &p, uint8_t *smem, Ring &ring, const float (&acc)[4]) {
  uint64_t *parked = reinterpret_cast<uint64_t *>(smem + p.smem.parked);
  uint64_t *freed = reinterpret_cast<uint64_t *>(smem + p.smem.freed);
  const int e = ring.epilogue.stage;
  mbar_wait(&freed[e], ring.epilogue.parity ^ 1);
  park_partials(reinterpret_cast<float *>(smem + p.smem.reduce) + e * kReduceFloats, acc);
  __syncwarp();
  if ((threadIdx.x & 31) == 0) mbar_arrive(&parked[e]);
  ring.epilogue.advance(Ring::kEpilogueWarps);
}

/* One token's FC2 rows of this warp's strip, stored by the MMA warp itself (one warp per
 * strip: no partial sums to add). Lanes t = 0 hold MMA column 0 (the token): rows g and
 * g + 8. The values are store_fc2_sums' bit for bit (0 + sum, times the row multiplier). */
__device__ __forceinline__ void store_token_rows(const Params &p, int tile, uint32_t slots, const float (&acc)[4]) {
  const int lane = threadIdx.x & 31, K = p.shape.top_k;
  if (lane & 3) return;
  const int col = (tile * kConsumerWarps + (int)(threadIdx.x >> 5)) * kStripRows + (lane >> 2);
  const float mult = row_multiplier(0);
  const __nv_bfloat16 lo = __float2bfloat16_rn((0.0f + acc[0]) * mult);
  const __nv_bfloat16 hi = __float2bfloat16_rn((0.0f + acc[2]) * mult);
  for (uint32_t m = slots; m != 0; m &= m - 1) {
    __nv_bfloat16 *row = p.out + ((int64_t)p.tok0 * K + (__ffs(m) - 1)) * p.out_ld + col;
    row[0] = lo;
    row[8] = hi;
  }
}

/* This CTA's tiles index, index + grid, ... < end, all of one phase: the loop holds no
 * per-tile dispatch, division or phase lookup (ncu, v10 at B = 8: the per-chunk
 * bookkeeping of a generic loop took 23 % of the MMA warps' samples; three divisions per
 * tile another 9 % of the call). acc: rows g / g+8 x token columns 2t / 2t+1 of this
 * warp's strip over its k-blocks, a fixed set in a fixed order (deterministic). */
template <int kUnits, int kStep, bool kLocalX, bool kChunkScale, bool kOneToken, class Ring>
__device__ __forceinline__ int consume_phase_tiles(const Params &p, uint8_t *smem, const Routing &r,
                                                    const ConsumerPlan &cp, int index, int end, Ring &ring) {
  static_assert(!kLocalX || kOneToken, "local x means one token");
  const bool direct = kStep == 1 && fc2_rows_by_mma_warps(p, kOneToken && kChunkScale);
  for (; index < end; index += gridDim.x) {
    KX_MARK_TILE_ENTER(index);
    KX_WAITS_DECLARE;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    /* the launch's one token's slots, before the chunks: off the tail. One token routes in one
     * warp, so unit u is compact expert u and its pairs are the token's slots (a scan of the K
     * slots here, on all 16 MMA warps at once, took B = 1's MMA warps ~0.7 kcycles a tile) */
    const int unit = direct ? p.fc2.per_tiles(index - cp.fc1_tiles) : 0;
    const int tile = index - cp.fc1_tiles - unit * p.fc2.tiles;
    const uint32_t slots = direct ? r.unit_pairs[unit] : 0;
    KX_MARK_TILE(index, kMarkTileStart);
    KX_MARK_TILE_AFTER(mbar_wait(&ring.full[ring.pos.stage], ring.pos.parity), index, kMarkTileData);
    uint32_t x_chunk = cp.x_local; /* local x: chunk c's blocks */
    for (int c = 0; c < cp.full_chunks; ++c, ring.pos.advance(kStages), x_chunk += cp.chunk_act_bytes) {
      const uint32_t stage = ring.stages + ring.pos.stage * kStageBytes;
      KX_TIMED_WAIT(mbar_wait(&ring.full[ring.pos.stage], ring.pos.parity));
      consume_units<kUnits, kStep, kChunkScale, kOneToken>(stage, kLocalX ? x_chunk : stage, cp.full,
                                                           cp.chunk_scale, cp.released, &ring.empty[ring.pos.stage],
                                                           acc);
    }
    if (cp.short_last) {
      const uint32_t stage = ring.stages + ring.pos.stage * kStageBytes;
      KX_TIMED_WAIT(mbar_wait(&ring.full[ring.pos.stage], ring.pos.parity));
      consume_units<kUnits, kStep, kChunkScale, kOneToken, true>(stage, kLocalX ? x_chunk : stage, cp.last,
                                                                 cp.chunk_scale, cp.released,
                                                                 &ring.empty[ring.pos.stage], acc, cp.last_units);
      ring.pos.advance(kStages);
    }
    KX_MARK_TILE(index, kMarkTileSums);
    KX_MARK_TILE_WAITS(index, cp.full_chunks + (cp.short_last ? 1 : 0));
    if (direct) store_token_rows(p, tile, slots, acc);
    else hand_off(p, smem, ring, acc);
    KX_MARK_TILE(index, kMarkTileDone);
  }
  return index; /* the first of the CTA's tiles at or past end: the next phase's first */
}

template <int kStep, bool kLocalX, bool kChunkScale, bool kOneToken, class Ring>
__device__ __forceinline__ int consume_phase_by_units(const Params &p, uint8_t *smem, const Routing &r,
                                                       const ConsumerPlan &cp, int index, int end, Ring &ring) {
  switch (cp.units) {
    case 4: return consume_phase_tiles<4, kStep, kLocalX, kChunkScale, kOneToken>(p, smem, r, cp, index, end, ring);
    case 3: return consume_phase_tiles<3, kStep, kLocalX, kChunkScale, kOneToken>(p, smem, r, cp, index, end, ring);
    case 2: return consume_phase_tiles<2, kStep, kLocalX, kChunkScale, kOneToken>(p, smem, r, cp, index, end, ring);
    case 1: return consume_phase_tiles<1, kStep, kLocalX, kChunkScale, kOneToken>(p, smem, r, cp, index, end, ring);
    default: return consume_phase_tiles<0, kStep, kLocalX, kChunkScale, kOneToken>(p, smem, r, cp, index, end, ring);
  }
}

/* The MMA warps' share of one phase: this CTA's tiles from `index` (stepping by the grid)
 * below `end`; the dispatch on the warp's plan happens once here. FC1 has 4 strips, so
 * its k-step is always 4; FC2's 4, 8 or 16 strips give 4, 2 or 1. One-token launches are
 * the local-x ones (kLocalXMaxTokens); tagged launches' FC2 sums take chunk multipliers. */
template <bool kLocalX, bool kTagged>
__device__ __forceinline__ int consume_phase(const Params &p, uint8_t *smem, const Routing &r, bool fc1,
                                              int fc1_tiles, int index, int end,
                                              ConsumerRing<Roles<kLocalX, kTagged>::kEpilogueWarps> &ring) {
  static_assert(kLocalXMaxTokens == 1 && (!kLocalX || kTagged), "local x: one token, tagged");
  const ConsumerPlan cp = consumer_plan<kLocalX>(p, smem, fc1, fc1_tiles);
  KX_MARK(fc1 ? kMarkFc1Planned : kMarkFc2Planned);
  if (fc1) {
    return consume_phase_by_units<kConsumerWarps / kFc1Strips, kLocalX, false, kLocalX>(p, smem, r, cp, index, end,
                                                                                        ring);
  }
  switch (cp.k_step) {
    case 4: return consume_phase_by_units<4, false, kTagged, kLocalX>(p, smem, r, cp, index, end, ring);
    case 2: return consume_phase_by_units<2, false, kTagged, kLocalX>(p, smem, r, cp, index, end, ring);
    default: return consume_phase_by_units<1, false, kTagged, kLocalX>(p, smem, r, cp, index, end, ring);
  }
}

/* Sum over the warps that share a strip, in warp order; times the token's row multiplier
 * 2^(R + 14) (mx.cuh). */
__device__ __forceinline__ float reduced(const float *reduce, int strips, int strip, int row, int token, float mult) {
  float sum = 0.0f;
  for (int w = strip; w < kConsumerWarps; w += strips) sum += reduce[w * kReducePitch + token * kStripRows + row];
  return sum * mult;
}

/* The same for rows row4 .. row4 + 3 (row4 % 4 == 0) of one token, one 16-byte load per warp. */
__device__ __forceinline__ void reduced4(const float *reduce, int strips, int strip, int row4, int token,
                                         float mult, float (&v)[4]) {
  float4 sum = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  for (int w = strip; w < kConsumerWarps; w += strips) {
    const float4 x = *reinterpret_cast<const float4 *>(reduce + w * kReducePitch + token * kStripRows + row4);
    sum.x += x.x; sum.y += x.y; sum.z += x.z; sum.w += x.w;
  }
  v[0] = sum.x * mult; v[1] = sum.y * mult; v[2] = sum.z * mult; v[3] = sum.w * mult;
}

/* ---- epilogues: one warp per tile, off the MMA warps' path --------------------------- */
/* Each tile's epilogue is two steps: store_*_sums reads the tile's partial sums out of
 * the warp's reduction slot, then publish_* does the global hand-offs (counters, fences,
 * the unit's quantization, the combine) after the slot went back to the MMA warps. */

/* What an epilogue warp needs of its tile's tokens, fetched while the MMA warps still work
 * on the tile, so the slot is held only for the sums. Lane i < count: token i, its row
 * multiplier 2^(R + 14) (mx.cuh; x's are in once x is, local x's once the sums are, a
 * unit's hidden rows' with them),
 * and for FC2's per-slot rows the slots that routed it here (a mask over the K slots), so
 * the column loop shuffles them instead of scanning all K slots per 4 columns. */
struct TileTokens {
  int token;
  float mult;
  uint32_t slots;
};

template <bool kLocalX, bool kTagged>
__device__ __forceinline__ TileTokens tile_tokens(const Params &p, const Routing &r, const Unit &unit,
                                                  const TileRef &ref, unsigned long long call) {
  const int lane = threadIdx.x & 31, K = p.shape.top_k;
  TileTokens tt{0, 0.0f, 0};
  if (lane >= unit.count) return tt;
  tt.token = nth_set_bit(unit.mask, unit.first_rank + lane);
  if (ref.fc1) {
    if (kLocalX) return tt; /* its multiplier comes once the sums are parked (run_epilogues) */
    wait_count(&p.sync->xq_ready, (unsigned int)call * gridDim.x);
    tt.mult = __ldcg(&p.x_mult[tt.token]);
  } else {
    if (kTagged) {
      tt.mult = row_multiplier(0); /* the blocks' scales are in the sums: no reference */
    } else {
      wait_equal(&p.sync->unit_ready[ref.unit], call);
      tt.mult = __ldcg(&p.h_mult[unit.row0 + lane]);
    }
    if (!p.route_weights) tt.slots = routed_slots(r, tt.token, K, unit.expert);
  }
  return tt;
}

/* FC1: SiTU -> h, and each hidden row's max |h| for its quantization (publish_fc1_tile);
 * tagged, the tile's block of each token quantized here and handed to FC2 as tagged words. */
template <bool kLocalX, bool kTagged>
__device__ void store_fc1_sums(const Params &p, const float *reduce, const Unit &unit, const TileRef &ref,
                               const TileTokens &tt, unsigned long long call) {
  const int lane = threadIdx.x & 31;
  static_assert(32 % kStripRows == 0, "a token's rows are whole lane groups");
  static_assert(kFc1Pairs * kStripRows == kMxBlock, "a tile's hidden columns are one block: lane k = column k");
  if constexpr (kTagged) {
    /* a pass per token (MMA column i), lane k = column k. One token (local x) has its
     * multiplier in every lane (run_epilogues), so its block's path to its tagged words holds
     * no shuffle but the quantization's */
    const int row = lane % kStripRows, pair = lane / kStripRows, count = kLocalX ? 1 : unit.count;
    for (int i = 0; i < count; ++i) {
      const float mult = kLocalX ? tt.mult : __shfl_sync(0xFFFFFFFFu, tt.mult, i);
      const float gate = reduced(reduce, kFc1Strips, 2 * pair, row, i, mult);
      const float up = reduced(reduce, kFc1Strips, 2 * pair + 1, row, i, mult);
      KX_MARK_TILE_AFTER_VALUE_BY_IF(lane == 0, ref.unit * p.fc1.tiles + ref.tile, kMarkTileSummed, gate + up);
      const float h = situ(gate, up, p.beta, p.linear_beta);
      KX_MARK_TILE_AFTER_VALUE_BY_IF(lane == 0, ref.unit * p.fc1.tiles + ref.tile, kMarkTileActivated, h);
      /* FC1 tile f's 32 hidden columns are FC2's k-block f */
      store_handoff_block(p.handoff + ((int64_t)(unit.row0 + i) * p.fc2.k_blocks + ref.tile) * kHandoffWordsPerBlock,
                          h, p.hidden_floor, call);
    }
  } else {
    const int I = p.shape.inter, items = unit.count * kFc1Pairs * kStripRows;
    for (int base = 0; base < items; base += 32) { /* uniform trip count: every lane shuffles */
      const int o = base + lane, row = o % kStripRows, pair = (o / kStripRows) % kFc1Pairs;
      const int token = (o < items ? o : items - 1) / (kStripRows * kFc1Pairs);
      const float mult = __shfl_sync(0xFFFFFFFFu, tt.mult, token);
      float h = 0.0f;
      if (o < items) {
        const float gate = reduced(reduce, kFc1Strips, 2 * pair, row, token, mult);
        const float up = reduced(reduce, kFc1Strips, 2 * pair + 1, row, token, mult);
        h = situ(gate, up, p.beta, p.linear_beta);
        p.h[(int64_t)(unit.row0 + token) * I + (ref.tile * kFc1Pairs + pair) * kStripRows + row] = h;
      }
      uint32_t m = __float_as_uint(h) & 0x7FFFFFFFu; /* |h| bits order like |h|; NaN above all */
      for (int d = kStripRows / 2; d > 0; d >>= 1) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, d));
      if (row == 0 && o < items) atomicMax(&p.sync->h_amax[unit.row0 + token], m);
    }
  }
}

/* The CTA that finishes a unit's last FC1 tile quantizes its h and releases it (not for
 * block-scaled rows: their tiles hand their blocks over themselves). Returns whether this was
 * that tile (the marks stamp the release). */
__device__ bool publish_fc1_tile(const Params &p, const Unit &unit, const TileRef &ref, unsigned long long call) {
  const int lane = threadIdx.x & 31, I = p.shape.inter;
  int last = 0;
  if (lane == 0) {
    fence_acq_rel_gpu(); /* release this tile's h */
    const unsigned int last_count = p.fc1.tiles - 1; /* the count wraps to 0 there */
    last = atomicInc(&p.sync->fc1_done[ref.unit], last_count) == last_count;
  }
  if (!__shfl_sync(0xFFFFFFFFu, last, 0)) return false;
  /* acquire the other tiles' h for every lane, though only lane 0's atomic saw the count:
   * as fence.acq_rel (enough at the other hand-offs) the lanes read stale hidden rows in
   * the race checks, so this one stays sequentially consistent */
  __threadfence();

  /* every FC1 tile of the unit is in, so its rows' max |h| are final: each lane loads its
   * block's row's with its h (plain loads, one round trip for both) */
  const unsigned int *row_amax = p.sync->h_amax + unit.row0;
  const float my_amax = lane < unit.count ? __uint_as_float(__ldcg(row_amax + lane)) : 0.0f;
  const int kb_per_row = I / kMxBlock, blocks = unit.count * kb_per_row;
  /* a warp-uniform trip count: as a plain strided loop ptxas spilled 28 bytes elsewhere */
  for (int base = 0; base < blocks; base += 32) {
    const int b = base + lane;
    if (b >= blocks) continue;
    const int row_i = b / kb_per_row, r = unit.row0 + row_i, kb = b - row_i * kb_per_row;
    const float4 *src = reinterpret_cast<const float4 *>(p.h + (int64_t)r * I + kb * kMxBlock);
    const float amax = __uint_as_float(__ldcg(row_amax + row_i));
    float v[kMxBlock];
#pragma unroll
    for (int i = 0; i < kMxBlock / 4; ++i) {
      const float4 f = __ldcg(src + i);
      v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
    }
    const int c = kb / p.fc2.chunk_kb, in_chunk = kb - c * p.fc2.chunk_kb;
    const int64_t block_row = hidden_block_row(p, c, r);
    quantize_store(v, p.hidden_floor, act_reference_exponent(amax, p.hidden_floor),
                   p.hq + block_row * block_row_bytes(p.fc2) + in_chunk * kActBlockBytes);
  }
  __syncwarp(); /* every lane has read the rows' max |h| */
  /* the rows' multipliers for the FC2 epilogues; their max |h| back to 0 for the next call */
  if (lane < unit.count) {
    p.h_mult[unit.row0 + lane] = row_multiplier(act_reference_exponent(my_amax, p.hidden_floor));
    p.sync->h_amax[unit.row0 + lane] = 0;
  }
  __syncwarp();
  if (lane == 0) store_release(&p.sync->unit_ready[ref.unit], call); /* a release: no fence first */
  return true;
}

/* FC2: bf16 rows to every slot that routed the token here, or to y for the combine. */
__device__ void store_fc2_sums(const Params &p, const float *reduce, const Unit &unit, const TileRef &ref,
                               const TileTokens &tt) {
  const int lane = threadIdx.x & 31, K = p.shape.top_k, H = p.shape.hidden, strips = p.fc2.strips;
  /* 4 consecutive output columns per step: quads = 2^quads_log2 steps per token (strips is
   * 4, 8 or 16), so the item loop splits its index by shifts */
  const int quads_log2 = __ffs(strips * kStripRows / 4) - 1, quads = 1 << quads_log2;
  const int items = unit.count * quads;
  for (int base = 0; base < items; base += 32) { /* uniform trip count: every lane shuffles */
    const int o = base + lane, token_i = (o < items ? o : items - 1) >> quads_log2;
    const int t = __shfl_sync(0xFFFFFFFFu, tt.token, token_i);
    const uint32_t t_slots = __shfl_sync(0xFFFFFFFFu, tt.slots, token_i);
    const float mult = __shfl_sync(0xFFFFFFFFu, tt.mult, token_i);
    if (o >= items) continue;
    const int row4 = (o & (quads - 1)) * 4, strip = row4 / kStripRows, row = row4 % kStripRows;
    const int col0 = ref.tile * strips * kStripRows + row4;
    float v[4];
    reduced4(reduce, strips, strip, row, token_i, mult, v);
    if (p.route_weights) {
      store_bf16x4(p.y + (int64_t)(unit.row0 + token_i) * H + col0, v);
    } else {
      for (uint32_t m = t_slots; m != 0; m &= m - 1)
        store_bf16x4(p.out + ((int64_t)(p.tok0 + t) * K + (__ffs(m) - 1)) * p.out_ld + col0, v);
    }
  }
}

/* z[t, cols] = bf16(sum_j w[t, j] * y[t, j, cols]) in slot order, by whichever CTA
 * delivers the last expert of (t, tile). */
__device__ void combine_ready_tokens(const Params &p, const Routing &r, const Unit &unit, int tile) {
  const int lane = threadIdx.x & 31, K = p.shape.top_k, H = p.shape.hidden;
  const int cols = p.fc2.strips * kStripRows, tiles_per_row = H / kMinTileCols;
  __syncwarp();
  int last_token = -1;
  if (lane < unit.count) {
    const int t = nth_set_bit(unit.mask, unit.first_rank + lane);
    int *count = &p.combine_count[t * tiles_per_row + tile];
    fence_acq_rel_gpu();
    if (atomicAdd(count, 1) == r.token_experts[t] - 1) {
      *count = 0; /* every arrival is in: the counter is ours to reset */
      last_token = t;
    }
    fence_acq_rel_gpu();
  }
  for (int i = 0; i < unit.count; ++i) {
    const int t = __shfl_sync(0xFFFFFFFFu, last_token, i);
    if (t < 0) continue;
    for (int col = lane; col < cols; col += 32) {
      const int64_t c = (int64_t)tile * cols + col;
      float z = 0.0f;
      for (int j = 0; j < K; ++j) {
        const int e = r.pair_expert[t * K + j];
        if (e < 0) { z = __int_as_float(0x7FC00000); break; } /* a bad id: the whole row is NaN */
        const int hr = hidden_row(r, r.expert_slot[e], t);
        z = fmaf(p.route_weights[t * p.rw_ld + j], __bfloat162float(__ldcg(p.y + (int64_t)hr * H + c)), z);
      }
      p.out[(int64_t)(p.tok0 + t) * p.out_ld + c] = __float2bfloat16_rn(z);
    }
  }
}

/* Epilogue warp e takes this CTA's tiles e, e + Roles::kEpilogueWarps, ... */
template <bool kLocalX, bool kTagged>
__device__ void run_epilogues(const Params &p, uint8_t *smem, const Routing &r, int total_tiles, int fc1_tiles,
                              unsigned long long call) {
  using R = Roles<kLocalX, kTagged>;
  const int e = (threadIdx.x >> 5) - R::kFirstEpilogueWarp, lane = threadIdx.x & 31;
  uint64_t *parked = reinterpret_cast<uint64_t *>(smem + p.smem.parked);
  uint64_t *freed = reinterpret_cast<uint64_t *>(smem + p.smem.freed);
  const float *reduce = reinterpret_cast<const float *>(smem + p.smem.reduce) + e * kReduceFloats;
  const float *local_x_mult = reinterpret_cast<const float *>(smem + p.smem.x_local_mult);
  KX_MARK_BY_IF_AFTER(e == 0 && lane == 0 && (int)blockIdx.x < total_tiles,
                      mbar_wait(reinterpret_cast<uint64_t *>(smem + p.smem.full), 0), kMarkFirstFull);
  RingPos slot; /* whose turn this CTA's tile is, as hand_off counts */
  const int end = fc2_rows_by_mma_warps(p, kLocalX) ? fc1_tiles : total_tiles;
  for (int index = blockIdx.x; index < end; index += gridDim.x, slot.advance(R::kEpilogueWarps)) {
    if (slot.stage != e) continue;
    const TileRef ref = tile_ref(p, index, fc1_tiles);
    const Unit unit = unit_info(r, ref.unit);
    TileTokens tt = tile_tokens<kLocalX, kTagged>(p, r, unit, ref, call);
    mbar_wait(&parked[e], slot.parity);
    KX_MARK_TILE_BY_IF(lane == 0, index, kMarkTileParked);
    /* local x's multipliers: the MMA warps wrote them before they parked anything */
    if (kLocalX && ref.fc1) tt.mult = local_x_mult[0]; /* the launch's one token, in every lane */
    if (ref.fc1) store_fc1_sums<kLocalX, kTagged>(p, reduce, unit, ref, tt, call);
    else store_fc2_sums(p, reduce, unit, ref, tt);
    KX_MARK_TILE_NS_BY_IF(lane == 0 && ref.fc1, index, kMarkTileStored);
    KX_MARK_TILE_BY_IF(lane == 0, index, kMarkTileEpilogue);
    __syncwarp();
    /* the slot is free before the hand-offs (a unit's fence, atomic and quantization): the
     * MMA warps waited for a slot 6 % of their loop at B = 64; this gave -0.7 % at B = 8 */
    if (lane == 0) mbar_arrive(&freed[e]);
    if (!ref.fc1) {
      if (p.route_weights) combine_ready_tokens(p, r, unit, ref.tile);
    } else if (!kTagged) {
      if (publish_fc1_tile(p, unit, ref, call)) KX_MARK_TILE_NS_BY_IF(lane == 0, index, kMarkTileReleased);
    }
  }
}

/* ---- rows that no tile writes: bad ids (SPEC 7) ------------------------------------ */
/* By the epilogue warps (tid: a thread's index among them) before their first tile, which
 * comes a tile's chunks later: on the MMA warps this was on B = 1's path to its first MMA. */
template <int kThreadsWriting>
__device__ void write_nan_rows(const Params &p, const Routing &r, int tid) {
  const int K = p.shape.top_k, H = p.shape.hidden;
  const __nv_bfloat16 nan = __ushort_as_bfloat16(kBf16Nan);
  if (p.route_weights) {
    for (int t = blockIdx.x; t < p.tokens; t += gridDim.x)
      if (r.token_experts[t] == 0)
        for (int c = tid; c < H; c += kThreadsWriting) p.out[(int64_t)(p.tok0 + t) * p.out_ld + c] = nan;
  } else {
    for (int q = blockIdx.x; q < p.tokens * K; q += gridDim.x)
      if (r.pair_expert[q] < 0)
        for (int c = tid; c < H; c += kThreadsWriting) p.out[(int64_t)(p.tok0 * K + q) * p.out_ld + c] = nan;
  }
}

/* ---- x -> MXFP8 in scratch, as the MMAs take it: row t by CTA t % grid -------------- */
/* The MMA threads of a CTA share a row: each loads its blocks and keeps their max |x|,
 * the row's max meets in shared memory (row_amax[i] for the CTA's i-th row, zeroed at
 * the kernel's start), then each quantizes its blocks against the row's reference
 * exponent (mx.cuh), the first held in registers (reloaded from L1 it took ~0.5 kcycle of
 * B = 1's start, session 35), any others reloaded. One L2 round trip per row, as with a block
 * per thread over the grid (v22b); a warp per 32 blocks that read its whole row for the
 * reference (v23) took four. x: the launch's rows (or, warming the code, any readable
 * bytes); count: whether this CTA counts in xq_ready (not when warming). */
template <bool kLocalX>
__device__ void quantize_x(const Params &p, uint8_t *smem, unsigned int *row_amax, const __nv_bfloat16 *x,
                           bool count) {
  const int H = p.shape.hidden, kb_per_row = H / kMxBlock;
  /* local x: every CTA quantizes every row into its own shared memory */
  float *mult = kLocalX ? reinterpret_cast<float *>(smem + p.smem.x_local_mult) : p.x_mult;
  for (int t = kLocalX ? 0 : blockIdx.x, i = 0; t < p.tokens; t += kLocalX ? 1 : gridDim.x, ++i) {
    const __nv_bfloat16 *row = x + t * p.x_ld;
    uint32_t m = 0; /* |x| bits order like |x|; NaN above all */
    XBlock held;    /* the thread's first block, held across the barrier: its only one up to H = 16384 */
    for (int kb = threadIdx.x; kb < kb_per_row; kb += kConsumerThreads) {
      const XBlock b = load_x_block(row + kb * kMxBlock);
      if (kb == threadIdx.x) held = b;
      m = max(m, b.amax_bits);
    }
    if (m != 0) atomicMax(&row_amax[i], m);
    named_barrier(kConsumerBarrier, kConsumerThreads);
    const int ref_exp = act_reference_exponent(__uint_as_float(row_amax[i]), false);
    if (threadIdx.x == 0) mult[t] = row_multiplier(ref_exp);
    uint8_t *dst = kLocalX ? smem + p.smem.x_local + t * local_x_pitch(H) : p.xq + (int64_t)t * H * 2;
    for (int kb = threadIdx.x; kb < kb_per_row; kb += kConsumerThreads)
      quantize_store_x(kb == threadIdx.x ? held : load_x_block(row + kb * kMxBlock), ref_exp,
                       dst + kb * kActBlockBytes);
  }
  named_barrier(kConsumerBarrier, kConsumerThreads);
  if (threadIdx.x == 0 && count) {
    if (!kLocalX) fence_acq_rel_gpu(); /* x's rows go to the other CTAs */
    atomicAdd(&p.sync->xq_ready, 1); /* every call counts: call n's x is in at n * grid */
  }
}

/* ---- the kernel -------------------------------------------------------------------- */
/* CTA 0 reports a bad id of the launch (SPEC 7). */
__device__ __forceinline__ void report_bad_id(const Params &p, int pair, int id) {
  if (blockIdx.x != 0) return;
  const unsigned long long key = ((unsigned long long)(p.tok0 * p.shape.top_k + pair) << 32) | (uint32_t)id;
  atomicMax(&p.sync->fault, ~key);
}

/* The routing group's tables for this launch (route.cuh). */
__device__ __forceinline__ void route_launch(const Params &p, const Routing &r, int route_tid) {
  const auto report_bad = [&](int pair, int id) { report_bad_id(p, pair, id); };
  if (!one_warp_routes(p.tokens, p.shape.top_k))
    route_pairs(r, p.ids, p.ids_ld, p.tokens, p.shape.top_k, p.shape.experts, route_tid, report_bad);
  else if (route_tid < 32)
    route_one_warp(r, p.ids, p.ids_ld, p.tokens, p.shape.top_k, p.shape.experts, route_tid, report_bad);
}

/* The routing of a one-token launch by its router warp (one_warp_routes); warm: on dummy
 * ids in shared memory, reporting nothing (warm_then_run). It writes only entries of the
 * tables that the real pass rewrites or that this warp's share of routing_clear (e < 32,
 * t < 32) clears after it. */
__device__ __forceinline__ void route_one_token(const Params &p, const Routing &r, int lane, bool warm) {
  int *dummy_ids = r.scan_tmp;
  if (warm) {
    dummy_ids[lane] = lane;
    __syncwarp();
  }
  route_one_warp(r, warm ? dummy_ids : p.ids, warm ? p.shape.top_k : p.ids_ld, 1, p.shape.top_k, p.shape.experts,
                 lane, [&](int pair, int id) { if (!warm) report_bad_id(p, pair, id); });
  KX_MARK_BY_IF(!warm && lane == 0, kMarkRouterTables);
}

/* Runs step(true) before the predecessor wait, then step(false) after it, from one call
 * site. B = 1's start is instruction-fetch bound (session 23's ncu: its blocks stalled on
 * no_instruction 64-99 %) and only running code warms it, so a one-token launch's router
 * and MMA warps run their first step once ahead on dummy data while the predecessor ends
 * (-3.8 % at B = 1). wait: this warp's share of phase 0, up to the predecessor wait. */
template <typename Step, typename Wait>
__device__ __forceinline__ void warm_then_run(Step step, Wait wait) {
#pragma unroll 1
  for (int pass = 0;; ++pass) {
    step(pass == 0);
    if (pass == 1) return;
    wait();
  }
}

/* Keeps this CTA's call number where its roles read it and where the next call counts from. */
__device__ __forceinline__ void record_call(const Params &p, unsigned long long *call_slot, unsigned long long call) {
  *call_slot = call;
  p.sync->calls[blockIdx.x] = call; /* read by the next call, after this one is done */
}

/* kLocalX: a launch of at most smem.x_local_rows tokens, its x in every CTA's shared
 * memory; kTagged: a launch that hands its hidden rows to FC2 as tagged words (launch_kind).
 * The other launches run the kernel without any of that code. */
template <bool kLocalX, bool kTagged>
__global__ void __launch_bounds__(kThreads, 1) experts_kernel(const __grid_constant__ Params p) {
  using R = Roles<kLocalX, kTagged>;
  extern __shared__ __align__(128) uint8_t smem[];
  KX_MARK(kMarkEntry);
  KX_MARK_NS(kMarkEntryNs);
  const SmemLayout &L = p.smem;
  const Routing r{reinterpret_cast<int16_t *>(smem + L.pair_expert), reinterpret_cast<uint32_t *>(smem + L.expert_slot),
                  reinterpret_cast<unsigned long long *>(smem + L.token_mask),
                  reinterpret_cast<uint16_t *>(smem + L.expert_id), reinterpret_cast<int *>(smem + L.expert_scan),
                  reinterpret_cast<uint16_t *>(smem + L.unit_expert), smem + L.unit_group,
                  reinterpret_cast<int *>(smem + L.token_experts), reinterpret_cast<int *>(smem + L.token_bad),
                  reinterpret_cast<uint32_t *>(smem + L.chunk_mask), reinterpret_cast<int *>(smem + L.scan_tmp),
                  reinterpret_cast<int *>(smem + L.totals), reinterpret_cast<uint32_t *>(smem + L.unit_pairs)};
  const int warp = threadIdx.x >> 5;
  unsigned long long *call_slot = reinterpret_cast<unsigned long long *>(smem + L.call);

  /* 0. before the predecessor is done: nothing that reads its outputs */
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      /* the weights' expect_tx, the filling activation producer's expect_tx and the others' arrivals
       * (a tagged FC2 chunk's gatherer arrives for all) */
      mbar_init(reinterpret_cast<uint64_t *>(smem + L.full) + s, 1 + R::kActivationWarps);
      mbar_init(reinterpret_cast<uint64_t *>(smem + L.empty) + s, kConsumerThreads);
    }
    for (int e = 0; e < R::kEpilogueWarps; ++e) {
      mbar_init(reinterpret_cast<uint64_t *>(smem + L.parked) + e, kConsumerWarps);
      mbar_init(reinterpret_cast<uint64_t *>(smem + L.freed) + e, 1);
    }
    fence_barrier_init();
    KX_MARK(kMarkBarriersInit);
  }
  const int route_tid = threadIdx.x - kConsumerThreads;
  unsigned int *x_amax = reinterpret_cast<unsigned int *>(smem + L.x_amax);
  const auto clear_and_wait = [&] {
    KX_MARK(kMarkWarmed);
    if (warp >= kConsumerWarps) routing_clear(r, p.shape.experts, route_tid);
    else if (threadIdx.x < kMaxLaunchTokens) x_amax[threadIdx.x] = 0;
    KX_MARK(kMarkPrologue);
    __syncthreads();
    /* the next launch's CTAs may take the SMs of ours that finish early and run their part 0
     * there; they wait for all of ours to finish before reading anything */
    allow_dependents();
    wait_for_predecessor();
    KX_MARK(kMarkWaited);
    KX_MARK_NS(kMarkWaitedNs);
  };
  /* one-token launches: the router warp routes and the MMA warps quantize x here, warmed */
  if (kLocalX && warp == kWeightWarp) {
    warm_then_run([&](bool warm) { route_one_token(p, r, route_tid, warm); }, clear_and_wait);
  } else if (kLocalX && warp < kConsumerWarps) {
    /* warm: whatever local x holds, not counted in xq_ready; its row max is cleared after */
    const auto *local_x = reinterpret_cast<const __nv_bfloat16 *>(smem + L.x_local);
    warm_then_run([&](bool warm) { quantize_x<true>(p, smem, x_amax, warm ? local_x : p.x, !warm); },
                  clear_and_wait);
  } else {
    clear_and_wait();
  }

  /* 1. routing, while the MMA warps quantize x (the grid-wide wait for x then overlaps the
   *    routing instead of following it). With local x the routing warps go on to stream
   *    weights as soon as the tables are complete and only the MMA warps wait for both;
   *    without it one CTA barrier joins them (a split one cost up to 4 % there, v30n). */
  if constexpr (kLocalX) {
    if (warp < kConsumerWarps) {
      named_barrier(kRoutedBarrier, kThreads);
    } else {
      /* overlaps the routing: on a warp that one-warp routing leaves idle (on the router's
       * lane 0 the routing waited for this load before it loaded the ids) */
      if (route_tid == kRouteThreads - 32) record_call(p, call_slot, p.sync->calls[blockIdx.x] + 1);
      route_sync(); /* the router warp's tables are in */
      KX_MARK_BY_IF(route_tid == 0, kMarkRouterSynced);
      named_barrier_arrive(kRoutedBarrier, kThreads);
    }
  } else {
    unsigned long long call = 0;
    if (threadIdx.x == 0) call = p.sync->calls[blockIdx.x] + 1; /* used after x: the load overlaps it */
    if (warp < kConsumerWarps) {
      quantize_x<false>(p, smem, x_amax, p.x, true);
      KX_MARK(kMarkXCounted);
      if (threadIdx.x == 0) record_call(p, call_slot, call);
    } else {
      route_launch(p, r, route_tid);
      KX_MARK_BY_IF(route_tid == 0, kMarkRouteDone);
    }
    __syncthreads();
    KX_MARK_BY_IF(threadIdx.x == kWeightWarp * 32, kMarkPastJoin);
  }
  KX_MARK(kMarkRouted);
  const unsigned long long call = *call_slot;
  const int units = r.totals[1];
  const int fc1_tiles = units * p.fc1.tiles;
  const int total_tiles = fc1_tiles + units * p.fc2.tiles;

  if (warp == kWeightWarp) {
    produce_weights(p, smem, r, total_tiles, fc1_tiles);
  } else if (warp >= kActivationWarp && warp < R::kFirstEpilogueWarp) {
    produce_activations<kLocalX, kTagged>(p, smem, r, total_tiles, fc1_tiles, warp - kActivationWarp, call);
  } else if (warp >= R::kFirstEpilogueWarp) {
    /* 2. the rows no tile will write */
    write_nan_rows<R::kEpilogueWarps * 32>(p, r, threadIdx.x - R::kFirstEpilogueWarp * 32);
    KX_MARK_BY_IF(threadIdx.x == R::kFirstEpilogueWarp * 32, kMarkNanDone);
    run_epilogues<kLocalX, kTagged>(p, smem, r, total_tiles, fc1_tiles, call);
  } else {
    /* 3./4. the tiles, FC1's then FC2's: MMA, then the partial sums to an epilogue warp */
    ConsumerRing<R::kEpilogueWarps> ring{smem_addr(smem + L.ring), reinterpret_cast<uint64_t *>(smem + L.full),
                                         reinterpret_cast<uint64_t *>(smem + L.empty), RingPos{}, RingPos{}};
    /* FC2's tiles start where FC1's stopped (no division, nothing held across FC1's loop) */
    int index = blockIdx.x;
#pragma unroll 1
    for (int fc1 = 1; fc1 >= 0; --fc1) { /* one call site: the phase code is inlined once */
      index = consume_phase<kLocalX, kTagged>(p, smem, r, fc1, fc1_tiles, index, fc1 ? fc1_tiles : total_tiles, ring);
      KX_MARK(fc1 ? kMarkFc1Done : kMarkExit);
    }
    KX_MARK_NS(kMarkExitNs);
  }
}

/* the kernel for each kind of launch (launch_kind) */
enum LaunchKind { kWideLaunch, kTaggedLaunch, kOneTokenLaunch, kLaunchKinds };
void (*const kExpertsKernels[kLaunchKinds])(Params) = {experts_kernel<false, false>, experts_kernel<false, true>,
                                                       experts_kernel<true, true>};

/* One token with room for its x in shared memory: local x, tagged. FC1 in at most
 * kTaggedFc1Rounds rounds of the grid: tagged. Tagged launches need their hidden blocks to
 * fit the hand-off words. */
LaunchKind launch_kind(const kx_moe_shape &s, const SmemLayout &L, const PhaseShape &fc1, int tokens, int grid) {
  if (!handoff_fits(s, tokens)) return kWideLaunch;
  if (tokens <= L.x_local_rows) return kOneTokenLaunch;
  const int64_t fc1_tiles = (int64_t)tokens * s.top_k * fc1.tiles;
  return fc1_tiles <= (int64_t)kTaggedFc1Rounds * grid ? kTaggedLaunch : kWideLaunch;
}

int launch_tokens_for(const kx_moe_shape &s) {
  const int by_pairs = kMaxPairs / s.top_k;
  return by_pairs < kMaxLaunchTokens ? by_pairs : kMaxLaunchTokens;
}

bool shape_ok(const kx_moe_shape &s) {
  return s.hidden > 0 && s.hidden % 64 == 0 && s.inter > 0 && s.inter % 32 == 0 && s.top_k >= 1 &&
         s.top_k <= 32 && s.experts >= 1 && s.experts <= 4096;
}

}  // namespace
}  // namespace kx

/* ---- host entry points ------------------------------------------------------------ */
extern "C" cudaError_t kx_moe_configure(const kx_moe_shape *shape, int device, kx_moe_config *config) {
  using namespace kx;
  *config = kx_moe_config{};
  if (!shape_ok(*shape)) return cudaErrorInvalidValue;
  const int tokens = launch_tokens_for(*shape);
  const SmemLayout L = smem_layout(shape->experts, launch_pairs(*shape, tokens), shape->hidden);
  int sms = 0, max_smem = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  if (L.bytes > max_smem || sms > kMaxGrid) return cudaErrorInvalidConfiguration;
  for (int kind = 0; kind < kLaunchKinds; ++kind) {
    /* the limit belongs to the kernel, not to a layer: only ever raise it, so a smaller
     * layer configured later cannot break a larger one */
    cudaFuncAttributes attrs;
    err = cudaFuncGetAttributes(&attrs, kExpertsKernels[kind]);
    if (err == cudaSuccess && attrs.maxDynamicSharedSizeBytes < L.bytes)
      err = cudaFuncSetAttribute(kExpertsKernels[kind], cudaFuncAttributeMaxDynamicSharedMemorySize, L.bytes);
    if (err != cudaSuccess) return err;
    /* the CTAs hand work to each other through counters: all must be resident at once */
    int per_sm = 0;
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kExpertsKernels[kind], kThreads, L.bytes);
    if (err != cudaSuccess) return err;
    if (per_sm < 1) return cudaErrorInvalidConfiguration;
  }
  config->grid = sms;
  config->smem_bytes = L.bytes;
  config->chunk_tokens = tokens;
  return cudaSuccess;
}

extern "C" size_t kx_moe_scratch_bytes(const kx_moe_shape *shape, const kx_moe_config *config) {
  return (size_t)kx::scratch_layout(*shape, config->chunk_tokens).total;
}

extern "C" cudaError_t kx_moe_run(const kx_moe_args *a, cudaStream_t stream) {
  using namespace kx;
  const kx_moe_shape &s = a->shape;
  if (!shape_ok(s) || a->config.grid < 1 || a->config.chunk_tokens < 1) return cudaErrorInvalidValue;
  const ScratchLayout S = scratch_layout(s, a->config.chunk_tokens);
  uint8_t *scratch = (uint8_t *)a->scratch;
  Params p{};
  p.shape = s;
  p.fc1 = fc1_shape(s.experts, s.hidden, s.inter);
  p.fc2 = fc2_shape(s.experts, s.hidden, s.inter);
  const int pairs = launch_pairs(s, a->config.chunk_tokens);
  p.smem = smem_layout(s.experts, pairs, s.hidden);
  p.packed = (const uint8_t *)a->packed;
  p.out = (__nv_bfloat16 *)a->out;
  p.out_ld = a->out_row_stride;
  p.beta = a->beta;
  p.linear_beta = a->linear_beta;
  p.hidden_floor = a->hidden_floor != 0;
  p.sync = (SyncWords *)(scratch + S.sync);
  p.combine_count = (int *)(scratch + S.combine_count);
  p.xq = scratch + S.xq;
  p.x_mult = (float *)(scratch + S.x_mult);
  p.h = (float *)(scratch + S.h);
  p.hq = scratch + S.hq;
  p.h_mult = (float *)(scratch + S.h_mult);
  p.handoff = (unsigned long long *)(scratch + S.handoff);
  p.hidden_rows = pairs;
  p.y = (__nv_bfloat16 *)(scratch + S.y);
  p.rw_ld = a->weights_row_stride;
  p.x_ld = a->x_row_stride;
  p.ids_ld = a->ids_row_stride;

  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(a->config.grid);
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = p.smem.bytes;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  for (int tok0 = 0; tok0 < a->batch; tok0 += a->config.chunk_tokens) {
    p.tok0 = tok0;
    p.tokens = a->batch - tok0 < a->config.chunk_tokens ? a->batch - tok0 : a->config.chunk_tokens;
    p.x = (const __nv_bfloat16 *)a->x + tok0 * a->x_row_stride;
    p.ids = a->ids + tok0 * a->ids_row_stride;
    p.route_weights = a->route_weights ? a->route_weights + tok0 * a->weights_row_stride : nullptr;
    const LaunchKind kind = launch_kind(s, p.smem, p.fc1, p.tokens, a->config.grid);
    cudaError_t err = cudaLaunchKernelEx(&cfg, kExpertsKernels[kind], p);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

#ifdef KX_MARKS
extern "C" cudaError_t kx_marks_clear(cudaStream_t stream) {
  void *marks = nullptr, *tile_marks = nullptr;
  cudaError_t err = cudaGetSymbolAddress(&marks, kx::g_marks);
  if (err == cudaSuccess) err = cudaGetSymbolAddress(&tile_marks, kx::g_tile_marks);
  if (err == cudaSuccess) err = cudaMemsetAsync(marks, 0, sizeof kx::g_marks, stream);
  return err != cudaSuccess ? err : cudaMemsetAsync(tile_marks, 0, sizeof kx::g_tile_marks, stream);
}

extern "C" cudaError_t kx_marks_read(unsigned long long *host, int ctas, unsigned long long *tile_host, int tiles) {
  cudaError_t err = cudaMemcpyFromSymbol(host, kx::g_marks, sizeof(unsigned long long) * kx::kMarkSlots * ctas);
  return err != cudaSuccess ? err
                            : cudaMemcpyFromSymbol(tile_host, kx::g_tile_marks,
                                                   sizeof(unsigned long long) * kx::kMarksPerTile * tiles);
}
#endif

extern "C" cudaError_t kx_moe_read_fault(void *scratch, const kx_moe_config *config, const kx_moe_shape *shape,
                                         kx_moe_fault *fault, cudaStream_t stream) {
  using namespace kx;
  *fault = kx_moe_fault{};
  const ScratchLayout S = scratch_layout(*shape, config->chunk_tokens);
  unsigned long long *word = &((SyncWords *)((uint8_t *)scratch + S.sync))->fault;
  unsigned long long inverted = 0;
  cudaError_t err = cudaMemcpyAsync(&inverted, word, sizeof inverted, cudaMemcpyDeviceToHost, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  if (err != cudaSuccess) return err;
  if (inverted == 0) return cudaSuccess;
  const unsigned long long key = ~inverted;
  const int pair = (int)(key >> 32);
  fault->bad = 1;
  fault->token = pair / shape->top_k;
  fault->slot = pair % shape->top_k;
  fault->id = (int32_t)(uint32_t)(key & 0xFFFFFFFFu);
  err = cudaMemsetAsync(word, 0, sizeof *word, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  return err;
}
