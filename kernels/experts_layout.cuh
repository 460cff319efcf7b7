/* experts_layout.cuh: the experts kernel's constants, warp roles, scratch (global) and
 * shared-memory layouts and kernel parameters, for its host entry points and its device
 * code (the packed weights' own layout: moe_layout.cuh).
 * One translation unit with experts.cu, which includes its parts in order. */
#pragma once

#include <cuda_bf16.h>

#include "kimi_kernels.h"
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
KX_HOST_DEVICE constexpr int act_row_value_bytes(int chunk_kb) {
  return (chunk_kb * kActBlockBytes + 127) / 128 * 128;
}
KX_HOST_DEVICE constexpr int act_row_bytes(int chunk_kb) { return act_row_value_bytes(chunk_kb) + kActRowPad; }
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
 * the last x row: at H = 4224 (132 k-blocks in chunks of 15: 8 x 15 + 12) 128 bytes past the
 * end of shared memory without this room. */
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
KX_HOST_DEVICE int chunk_scale_offset(const PhaseShape &ph) { return act_row_value_bytes(ph.chunk_kb); }
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

/* Combined launches of a few tokens hand FC2's rows to the combine as tagged row words, as FC1
 * hands its hidden blocks to FC2: two bf16 of hidden row r in a word's low 32 bits, the call
 * number's low 32 bits above them. A 64-bit store is single-copy atomic, so a word with the call's
 * tag holds the call's data: no fence, counter or copy between the rows and the combine (v84:
 * -1.5 % at k3-tp8 B = 1 combined beside the counter path; session 47). Row r's words are
 * r (H / 2) .. + H / 2 - 1, in the order of the path that stores them: columns 16 (w / 8) + w % 8
 * and that + 8 (the MMA fragment's rows g and g + 8) where the MMA warps store one token's rows
 * (store_token_rows), columns 2w and 2w + 1 where the epilogue warps store them (store_fc2_sums).
 * Tags repeat only 2^32 calls apart. Fixed in size and offset for every shape (scratch_layout),
 * so that nothing but tagged words is ever read there; launches of more than
 * kRowWordsMaxTokens tokens, or of more rows than the words hold, take the counters. */
constexpr int kRowWords = 1 << 20; /* 8 MB: 36 tokens of k3-tp8's K x H / 2 */
constexpr int kRowWordsMaxTokens = 16; /* 8 -> 16: -2.7 % at TP16 B = 16; 36 gained nothing at B = 32 (session 49) */
KX_HOST_DEVICE bool row_words_fit(const kx_moe_shape &s, int tokens) {
  return tokens <= kRowWordsMaxTokens && (int64_t)tokens * s.top_k * (s.hidden / 2) <= kRowWords;
}

/* A row word: two bf16 (the first in the low half) under the call's tag, and whether a word
 * read back carries this call's tag (its data is then this call's). */
__device__ __forceinline__ unsigned long long row_word(unsigned long long call, uint32_t two_bf16) {
  return call << 32 | two_bf16;
}
__device__ __forceinline__ bool row_word_is_calls(unsigned long long word, unsigned long long call) {
  return (uint32_t)(word >> 32) == (uint32_t)call;
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
  unsigned int xq_ready;                    /* += 1 per CTA done quantizing x: call n's x is in at n * grid */
  unsigned long long calls[kMaxGrid];       /* calls run by CTA i */
  unsigned long long unit_ready[kMaxUnits]; /* the call that released unit u's hidden rows */
  unsigned int fc1_done[kMaxUnits];         /* unit u's FC1 tiles done, back to 0 at its last */
  unsigned int h_amax[kMaxPairs];           /* max |h| of hidden row r (float bits), 0 between calls */
};

struct ScratchLayout {
  int64_t sync, handoff, row_words, combine_count, xq, x_mult, h, hq, h_mult, y, total;
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
  L.row_words = at; at = align128(at + 8 * (int64_t)kRowWords);                             /* likewise */
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
  int item_rows, item_of_warp; /* the MMA warps' first combine items of a word launch (plan_word_item) */
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
  L.item_rows = take(4 * kConsumerThreads, 4);
  L.item_of_warp = take(4 * kConsumerWarps, 4);
  /* local x takes what the budget has left (the L1 carve-out is 228 KB either way) */
  L.x_local_mult = take(4 * kLocalXMaxTokens, 4);
  const int x_at = (int)align128(at);
  const int fit = (kSmemBudget - x_at - kLocalXOverread) / local_x_pitch(hidden);
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
  unsigned long long *fault; /* the layer's: ~((pair << 32) | id) of its first bad id, 0 = none */
  int *combine_count;
  uint8_t *xq; /* f16 values in fragment order (quantize_store) */
  float *x_mult; /* per x row: 2^(R + 14), R its reference exponent (mx.cuh) */
  float *h;
  uint8_t *hq; /* likewise, in unit blocks (block_row_bytes) */
  int hidden_rows; /* rows of h per launch: block row c * hidden_rows + r */
  float *h_mult;   /* per hidden row: 2^(R + 14) */
  unsigned long long *handoff; /* tagged launches' hidden blocks as tagged words */
  unsigned long long *row_words; /* combined launches' FC2 rows as tagged words (rows_as_words) */
  __nv_bfloat16 *y;
};

/* Whether FC2's rows go out from the MMA warps (store_token_rows) instead of an epilogue
 * warp: one-token launches (tagged, block-scaled hidden rows) with one MMA warp per FC2 strip, so
 * there are no partial sums to add; combined, as tagged row words (row_words_fit), which the MMA
 * warps of the grid combine (combine_by_words<true>). The hop through an epilogue
 * warp is the call's last step there (session 28: -2.3 % at B = 1 without it). */
__device__ __forceinline__ bool fc2_rows_by_mma_warps(const Params &p, bool one_token) {
  return one_token && p.fc2.strips == kConsumerWarps && (!p.route_weights || row_words_fit(p.shape, 1));
}

/* Whether a combined launch's FC2 rows go to the combine as tagged row words (row_words_fit),
 * not to y and the arrival counters. */
__device__ __forceinline__ bool rows_as_words(const Params &p) { return row_words_fit(p.shape, p.tokens); }

/* Token t's arrival counter for 64 output columns (piece), [token][H / 64] (scratch_layout). */
__device__ __forceinline__ int *combine_counter(const Params &p, int t, int piece) {
  return &p.combine_count[t * (p.shape.hidden / kMinTileCols) + piece];
}

/* Block row of chunk c of hidden row `row` (the unit-block layout above). */
__device__ __forceinline__ int64_t hidden_block_row(const Params &p, int c, int row) {
  return (int64_t)c * p.hidden_rows + row;
}

}  // namespace
}  // namespace kx
