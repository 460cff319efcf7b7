/* experts_combine.cuh: the fused combine (SPEC 3 step 6), z[t] = bf16(sum_j w[t, j] y[t, j]),
 * each column one fmaf chain from 0 in slot order, run by the MMA warps once their tiles are
 * done. Launches of a few tokens (one-token launches whose MMA warps store the rows,
 * fc2_rows_by_mma_warps, among them) poll FC2's rows as tagged row words (rows_as_words); every other
 * combined launch reads them from y once the (token, piece) counter has counted every expert of
 * the token in.
 * One translation unit with experts.cu, which includes its parts in order. */
#pragma once

#include "experts_ops.cuh"
#include "marks.cuh"

namespace kx {
namespace {

/* Lane j < K's slot of token t: its hidden row and routing weight (0 and 0 past K or for a bad id),
 * for the lanes to shuffle round. */
struct SlotOfLane {
  int row;
  float weight;
};

__device__ __forceinline__ SlotOfLane slot_of_lane(const Params &p, const Routing &r, int t) {
  const int lane = threadIdx.x & 31, K = p.shape.top_k;
  SlotOfLane s{0, 0.0f};
  if (lane < K) {
    const int e = r.pair_expert[t * K + lane];
    if (e >= 0) s = SlotOfLane{hidden_row(r, r.expert_slot[e], t), __ldg(&p.route_weights[t * p.rw_ld + lane])};
  }
  return s;
}

/* The same, its row from shared memory where plan_word_item left it (rows: this warp's 32); the row's
 * lookups, unused, compile away. */
__device__ __forceinline__ SlotOfLane planned_slot_of_lane(const Params &p, const Routing &r, int t, const int *rows) {
  return SlotOfLane{rows[threadIdx.x & 31], slot_of_lane(p, r, t).weight};
}

/* Polls the row words at[i] of the slots whose bit is set in pending, every pending load in flight
 * at once, until each carries the call's tag; their data to v[i]. */
template <int kSlots>
__device__ __forceinline__ void poll_row_words(const Params &p, const uint32_t (&at)[kSlots], uint32_t pending,
                                               unsigned long long call, uint32_t (&v)[kSlots]) {
  int polls = 0; /* marks builds */
  while (__any_sync(0xFFFFFFFFu, pending != 0)) {
    if (polls == 0) KX_MARK(kMarkCombineIssued);
    unsigned long long word[kSlots];
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if (pending >> i & 1) word[i] = load_relaxed(p.row_words + at[i]);
#pragma unroll
    for (int i = 0; i < kSlots; ++i)
      if ((pending >> i & 1) && row_word_is_calls(word[i], call)) {
        v[i] = (uint32_t)word[i];
        pending &= ~(1u << i);
      }
    if (polls++ == 0 && pending != ~0u) { /* after the loads: pending is theirs */
      KX_MARK_NS(kMarkCombinePolledNs);
      KX_MARK(kMarkCombineBack);
    }
  }
  KX_MARK_NS(kMarkCombineSeenNs);
  KX_MARK_VALUE(kMarkCombinePolls, polls);
}

/* ---- through y, behind the arrival counters --------------------------------------------- */
/* z[t, piece's 64 columns]: the warp waits for the piece's counter to hold every valid expert of
 * t (the FC2 epilogues' release arrivals after their y rows, count_combine_arrivals), resets it
 * for the next call, and sums the slots' rows in slot order. Lane l owns columns 2l and 2l + 1;
 * a round's 16 slots' 4-byte loads are all in flight at once: one round trip to L2 at top-k 16
 * (pieces of 128 columns, four a lane, spilled 16 bytes with 16 slots a round, and in rounds of 8
 * read the same as these: session 48). The slots' rows and weights are fetched before the wait. */
constexpr int kCombineRoundSlots = 16;
static_assert(kMinTileCols == 64, "a combine piece: two columns a lane");

__device__ void combine_piece(const Params &p, const Routing &r, int t, int piece) {
  const int lane = threadIdx.x & 31, K = p.shape.top_k, H = p.shape.hidden;
  const SlotOfLane slot = slot_of_lane(p, r, t); /* lane j < K: slot j's */
  const bool nan_row = r.token_bad[t] != 0; /* a bad id in any slot */
  const int64_t c = (int64_t)piece * kMinTileCols + 2 * lane;
  int *count = combine_counter(p, t, piece);
  while ((int)load_relaxed(reinterpret_cast<const unsigned int *>(count)) != r.token_experts[t]) {
  }
  fence_acq_rel_gpu(); /* one acquire after the poll: ld.acquire is a load and a CCTL.IVALL of the SM's L1 */
  __syncwarp();
  if (lane == 0) *count = 0; /* every lane has seen every arrival: the counter is ours to reset */
  float z0 = 0.0f, z1 = 0.0f;
#pragma unroll 1
  for (int j0 = 0; j0 < K; j0 += kCombineRoundSlots) {
    uint32_t y[kCombineRoundSlots];
#pragma unroll
    for (int b = 0; b < kCombineRoundSlots; ++b) {
      const int row_j = __shfl_sync(0xFFFFFFFFu, slot.row, (j0 + b) & 31);
      y[b] = !nan_row && j0 + b < K ? __ldcg(reinterpret_cast<const unsigned int *>(p.y + (int64_t)row_j * H + c)) : 0u;
    }
#pragma unroll
    for (int b = 0; b < kCombineRoundSlots; ++b) {
      const float w = __shfl_sync(0xFFFFFFFFu, slot.weight, (j0 + b) & 31);
      if (j0 + b >= K) break;
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&y[b]));
      z0 = fmaf(w, v.x, z0);
      z1 = fmaf(w, v.y, z1);
    }
  }
  if (nan_row) z0 = z1 = __int_as_float(0x7FC00000);
  store_bf16x2(p.out + (int64_t)(p.tok0 + t) * p.out_ld + c, z0, z1);
}

/* This CTA's place in the order in which one-token launches' CTAs end their tiles, earliest first
 * (ties by index). Tiles go round the grid (tile i to CTA i % grid), FC1's then FC2's, so the CTAs
 * fall into three runs: [0, lo) with one more FC1 tile and one more tile than [hi, grid), and
 * [lo, hi) with one more FC1 tile (fc1_tiles % grid > total_tiles % grid) or one more tile. One
 * token's FC2 tiles wait for other CTAs' hidden words, so the CTAs with the fewest FC2 tiles end
 * first, and among equals those with the fewest chunks (marks, session 50: at k3-tp8 the CTAs of
 * 2 FC1 and 1 FC2 tiles by 13.1 us, of 1 and 2 up to 14.3, of 2 and 2 at 14.1-14.3; TP16's of 1 and
 * 1 by 9.5, of 0 and 2 and of 1 and 2 up to 10.8-11.0). */
__device__ __forceinline__ int one_token_cta_rank(const Params &p, int cta, int units) {
  const int grid = gridDim.x, fc1_tiles = units * p.fc1.tiles, total_tiles = fc1_tiles + units * p.fc2.tiles;
  const int r1 = fc1_tiles % grid, rt = total_tiles % grid, lo = min(r1, rt), hi = max(r1, rt);
  /* each run's FC1 and FC2 tiles over the run [hi, grid)'s, as one key: FC2 tiles first, then chunks */
  const auto key = [&](int more_fc1, int more_tiles) {
    const int more_fc2 = more_tiles - more_fc1;
    return more_fc2 * (1 << 16) + more_fc1 * p.fc1.chunks() + more_fc2 * p.fc2.chunks();
  };
  const int key0 = key(1, 1), key1 = key(r1 > rt, rt > r1), key2 = 0;
  const int run = cta < lo ? 0 : cta < hi ? 1 : 2, mine = run == 0 ? key0 : run == 1 ? key1 : key2;
  const auto before = [&](int key_q, int q) { return key_q < mine || (key_q == mine && q < run); };
  return cta - (run == 0 ? 0 : run == 1 ? lo : hi) + (before(key0, 0) ? lo : 0) + (before(key1, 1) ? hi - lo : 0) +
         (before(key2, 2) ? grid - hi : 0);
}

/* The launch's (token, piece) items go to every MMA warp of the grid: warp w of CTA b takes
 * b + grid (w + 16 k). In one-token launches whose MMA warps store the rows (kOneToken) the CTAs
 * that end their tiles first take them instead, all 16 warps of a CTA before the next (warp w of
 * the CTA of rank k: 16 k + w + 16 grid j; v89: k3-tp8 / TP16 B = 1 combined -3.0 / -4.9 %; ranked
 * by chunks alone, as session 49 tried at every B, TP16's went to CTAs that end late, and B >= 2
 * gained nothing). They wait after the warp's tiles, for FC2 tiles of other CTAs, which no combine
 * holds up (every CTA is resident), so the grid cannot deadlock. On the epilogue warp of each
 * token's last arriving tile (v79-v85) the combine's round trips held up the tiles behind it:
 * timing probes put them at 7-19 % of k3-tp8 / TP16 B = 64 (session 48). */
template <bool kOneToken, class CombinePiece>
__device__ __forceinline__ void combine_items(const Params &p, const Routing &r, int piece_cols,
                                              CombinePiece combine_piece_of, int skip = 0) {
  const int pieces = p.shape.hidden / piece_cols, items = p.tokens * pieces, warp = (int)(threadIdx.x >> 5);
  unsigned cta; /* read here: hoisted to the kernel's start, blockIdx.x + grid * warp spilled in the one-token kernel */
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(cta));
  const int first = kOneToken ? one_token_cta_rank(p, (int)cta, r.totals[1]) * kConsumerWarps + warp
                              : (int)cta + gridDim.x * warp;
  for (int i = first + skip * (int)gridDim.x * kConsumerWarps; i < items; i += gridDim.x * kConsumerWarps) {
    const int t = i / pieces;
    if (r.token_experts[t] != 0) combine_piece_of(t, i - t * pieces); /* else write_nan_rows' */
  }
}

__device__ void combine_by_counts(const Params &p, const Routing &r) {
  combine_items<false>(p, r, kMinTileCols, [&](int t, int piece) { combine_piece(p, r, t, piece); });
}

/* ---- a few tokens, through tagged row words --------------------------------------------- */
/* z[t, piece's 32 columns] from the slots' row words, polled until each carries the call's tag
 * (kFragmentOrder: one-token rows from the MMA warps, store_token_rows' order; else
 * store_fc2_sums', word w holding columns 2w and 2w + 1): no counter to wait for or reset, no
 * fence. In rounds of 16 slots, lane w + 16 h holds word w of slots 8h .. 8h + 7 of the round (8
 * words, 16 registers, in flight a lane: 32 spilled in combine_piece's first form); lane w then
 * sums all 16 in slot order, the other half's by shuffle (the fmaf chain of combine_piece, so the
 * same bits). */
constexpr int kWordPieceWords = 16;

template <bool kFragmentOrder>
__device__ void combine_word_piece(const Params &p, const Routing &r, int t, int piece, unsigned long long call,
                                   const int *planned_rows) {
  constexpr int kSlotsPerLane = 8;
  const int lane = threadIdx.x & 31, w = lane % kWordPieceWords, half = lane / kWordPieceWords;
  const int K = p.shape.top_k, words_per_row = p.shape.hidden / 2;
  const SlotOfLane slot = planned_rows ? planned_slot_of_lane(p, r, t, planned_rows)
                                       : slot_of_lane(p, r, t); /* lane j < K: slot j's */
  const bool nan_row = r.token_bad[t] != 0; /* a bad id in any slot: nothing to wait for */
  float lo = 0.0f, hi = 0.0f;
  for (int j0 = 0; j0 < K && !nan_row; j0 += 2 * kSlotsPerLane) {
    uint32_t at[kSlotsPerLane], v[kSlotsPerLane] = {};
    uint32_t pending = 0; /* bit i: slot j0 + 8 half + i, whose word has not shown the call's tag yet */
#pragma unroll
    for (int i = 0; i < kSlotsPerLane; ++i) {
      const int j = j0 + kSlotsPerLane * half + i;
      const int row_j = __shfl_sync(0xFFFFFFFFu, slot.row, j & 31);
      pending |= (uint32_t)(j < K) << i;
      at[i] = (uint32_t)(row_j * words_per_row + piece * kWordPieceWords + w);
    }
    poll_row_words(p, at, pending, call, v);
    uint32_t upper[kSlotsPerLane]; /* slots j0 + 8 .. j0 + 15, from lane w + 16 */
#pragma unroll
    for (int i = 0; i < kSlotsPerLane; ++i) upper[i] = __shfl_sync(0xFFFFFFFFu, v[i], w + kWordPieceWords);
#pragma unroll
    for (int k = 0; k < 2 * kSlotsPerLane; ++k) {
      const float wk = __shfl_sync(0xFFFFFFFFu, slot.weight, (j0 + k) & 31);
      if (j0 + k >= K) break;
      const uint32_t bits = k < kSlotsPerLane ? v[k] : upper[k - kSlotsPerLane];
      const float2 y = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&bits));
      lo = fmaf(wk, y.x, lo);
      hi = fmaf(wk, y.y, hi);
    }
  }
  if (__float_as_uint(lo) != ~0u) KX_MARK_NS(kMarkCombineSummedNs); /* after the sums: lo is theirs */
  if (half != 0) return;
  if (nan_row) lo = hi = __int_as_float(0x7FC00000);
  __nv_bfloat16 *z = p.out + (int64_t)(p.tok0 + t) * p.out_ld + piece * 2 * kWordPieceWords;
  if constexpr (kFragmentOrder) { /* word w: columns 16 (w / 8) + w % 8 and that + 8 (store_token_rows) */
    z += 16 * (w / 8) + w % 8;
    z[0] = __float2bfloat16_rn(lo);
    z[8] = __float2bfloat16_rn(hi);
  } else {
    store_bf16x2(z + 2 * w, lo, hi);
  }
}

/* Before the tiles, once the routing tables are in: this MMA warp's first combine item of a word
 * launch (combine_items' deal) and its slots' rows, to shared memory (-1: no item), so that after the
 * tiles the item's first poll waits for one shared load: its lookups there (a division, ~6 dependent
 * shared loads) took 1050-1500 cycles between the warp's last tile and that poll (marks, session 50). */
__device__ void plan_word_item(const Params &p, const Routing &r, uint8_t *smem) {
  const int pieces = p.shape.hidden / (2 * kWordPieceWords), items = p.tokens * pieces;
  const int warp = (int)(threadIdx.x >> 5), lane = threadIdx.x & 31;
  const int i = (int)blockIdx.x + gridDim.x * warp; /* launches of several tokens: combine_items' plain deal */
  const int t = i / pieces;
  const bool mine = i < items && r.token_experts[t] != 0; /* else write_nan_rows' */
  if (mine) reinterpret_cast<int *>(smem + p.smem.item_rows)[warp * 32 + lane] = slot_of_lane(p, r, t).row;
  if (lane == 0) reinterpret_cast<int *>(smem + p.smem.item_of_warp)[warp] = mine ? i : -1;
  __syncwarp();
}

/* The warp's items: kPlanned (plan_word_item ran before the tiles) its planned one, then (launches of
 * more items than the grid has MMA warps) its others; else all looked up here. */
template <bool kFragmentOrder, bool kPlanned>
__device__ void combine_by_words(const Params &p, const Routing &r, uint8_t *smem, unsigned long long call) {
  if constexpr (kPlanned) {
    const int warp = (int)(threadIdx.x >> 5), pieces = p.shape.hidden / (2 * kWordPieceWords);
    const int planned = reinterpret_cast<const int *>(smem + p.smem.item_of_warp)[warp];
    if (planned >= 0) {
      const int t = planned / pieces;
      combine_word_piece<kFragmentOrder>(p, r, t, planned - t * pieces, call,
                                         reinterpret_cast<const int *>(smem + p.smem.item_rows) + warp * 32);
    }
    if (p.tokens * pieces <= (int)gridDim.x * kConsumerWarps) return; /* one item a warp at most: planned */
  }
  combine_items<kFragmentOrder>(p, r, 2 * kWordPieceWords, [&](int t, int piece) {
    combine_word_piece<kFragmentOrder>(p, r, t, piece, call, nullptr);
  }, kPlanned ? 1 : 0); /* the planned item is each warp's first */
}

}  // namespace
}  // namespace kx
