/* experts_epilogues.cuh: the experts kernel's epilogue warps (each tile's reduction, SiTU
 * and MXFP8 hidden rows after FC1, bf16 rows and the combine's arrivals after FC2), the NaN rows of
 * bad ids (SPEC 7), and x's quantization to MXFP8.
 * One translation unit with experts.cu, which includes its parts in order. */
#pragma once

#include "experts_consumers.cuh"
#include "marks.cuh"

namespace kx {
namespace {

/* ---- epilogues: one warp per tile, off the MMA warps' path --------------------------- */
/* Each tile's epilogue is two steps: store_*_sums reads the tile's partial sums out of
 * the warp's reduction slot, then the global hand-offs follow once the slot went back to the
 * MMA warps (publish_fc1_tile: counters, fences, the unit's quantization; count_combine_arrivals:
 * the combine's arrivals). */

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

/* A unit's hidden rows wait in scratch for its finisher (publish_fc1_tile) as fp32 h, which the
 * finisher quantizes, or, for units of more than kFinisherBlocks hidden blocks, as MXFP8 that
 * each FC1 tile quantized itself, which the finisher only folds: the finisher is one warp, so
 * quantizing Mixtral 8x22B TP8's 512-block units there took it 17-56 us (session 57), while a
 * small unit's finisher takes one or two passes either way, which its tiles' quantization would
 * not shorten. The codes take the first I bytes of the row's 4 I, its block scales the next I / 32. */
constexpr int kFinisherBlocks = 64;

__device__ __forceinline__ bool tiles_quantize(const Params &p, const Unit &unit) {
  return unit.count * (p.shape.inter / kMxBlock) > kFinisherBlocks;
}

__device__ __forceinline__ uint8_t *hidden_codes(const Params &p, int64_t row) {
  return reinterpret_cast<uint8_t *>(p.h + row * p.shape.inter);
}

/* FC1 token i's h at this lane's hidden column of the tile (lane k = column k: the tile's 32
 * columns are one MXFP8 block of each token); mult is the token's row multiplier. stamp: the
 * marks build stamps the sums and h (tagged launches). */
__device__ __forceinline__ float fc1_token_h(const Params &p, const float *reduce, const TileRef &ref, int i,
                                             float mult, bool stamp) {
  const int lane = threadIdx.x & 31, row = lane % kStripRows, pair = lane / kStripRows;
  const float gate = reduced(reduce, kFc1Strips, 2 * pair, row, i, mult);
  const float up = reduced(reduce, kFc1Strips, 2 * pair + 1, row, i, mult);
  KX_MARK_TILE_AFTER_VALUE_BY_IF(stamp && lane == 0, ref.unit * p.fc1.tiles + ref.tile, kMarkTileSummed, gate + up);
  const float h = situ(gate, up, p.beta, p.linear_beta);
  KX_MARK_TILE_AFTER_VALUE_BY_IF(stamp && lane == 0, ref.unit * p.fc1.tiles + ref.tile, kMarkTileActivated, h);
  return h;
}

/* FC1: SiTU -> h, and each hidden row's max |h| for its quantization (publish_fc1_tile); tagged,
 * the tile's block of each token quantized here and handed to FC2 as tagged words; for a unit
 * whose tiles quantize (above), the same block quantized here into its row's codes. */
template <bool kLocalX, bool kTagged>
__device__ void store_fc1_sums(const Params &p, const float *reduce, const Unit &unit, const TileRef &ref,
                               const TileTokens &tt, unsigned long long call) {
  const int lane = threadIdx.x & 31, I = p.shape.inter;
  static_assert(32 % kStripRows == 0, "a token's rows are whole lane groups");
  static_assert(kFc1Pairs * kStripRows == kMxBlock, "a tile's hidden columns are one block: lane k = column k");
  if (kTagged || tiles_quantize(p, unit)) {
    /* a pass per token (MMA column i). One token (local x) has its multiplier in every lane
     * (run_epilogues), so its block's path to its tagged words holds no shuffle but the
     * quantization's */
    const int count = kLocalX ? 1 : unit.count;
    for (int i = 0; i < count; ++i) {
      const float mult = kLocalX ? tt.mult : __shfl_sync(0xFFFFFFFFu, tt.mult, i);
      const float h = fc1_token_h(p, reduce, ref, i, mult, kTagged);
      const int64_t r = unit.row0 + i;
      if constexpr (kTagged) {
        /* FC1 tile f's 32 hidden columns are FC2's k-block f */
        store_handoff_block(p.handoff + (r * p.fc2.k_blocks + ref.tile) * kHandoffWordsPerBlock, h, p.hidden_floor,
                            call);
      } else {
        uint8_t *codes = hidden_codes(p, r);
        uint32_t scale, amax_bits;
        codes[ref.tile * kMxBlock + lane] = (uint8_t)quantize_lanes(h, p.hidden_floor, &scale, &amax_bits);
        if (lane == 0) {
          codes[I + ref.tile] = (uint8_t)scale;
          atomicMax(&p.sync->h_amax[r], amax_bits);
        }
      }
    }
  } else {
    const int items = unit.count * kFc1Pairs * kStripRows;
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

/* Where hidden block kb of row r goes for FC2's MMAs. */
__device__ __forceinline__ uint8_t *hidden_block_dst(const Params &p, int64_t r, int kb) {
  const int c = kb / p.fc2.chunk_kb, in_chunk = kb - c * p.fc2.chunk_kb;
  return p.hq + hidden_block_row(p, c, r) * block_row_bytes(p.fc2) + in_chunk * kActBlockBytes;
}

/* The finisher's loop over a unit's hidden blocks, one block a lane a pass (a warp-uniform trip
 * count: as a plain strided loop ptxas spilled 28 bytes elsewhere): each block's loads first, then
 * its fp32 h quantized, or (kCodes) its codes folded, into hq. One instance per kind, so neither
 * loop holds the other's branch. */
template <bool kCodes>
__device__ __forceinline__ void finish_unit_blocks(const Params &p, const Unit &unit, const unsigned int *row_amax) {
  const int lane = threadIdx.x & 31, I = p.shape.inter, kb_per_row = I / kMxBlock, blocks = unit.count * kb_per_row;
  for (int base = 0; base < blocks; base += 32) {
    const int b = base + lane;
    if (b >= blocks) continue;
    const int row_i = b / kb_per_row, r = unit.row0 + row_i, kb = b - row_i * kb_per_row;
    const float amax = __uint_as_float(__ldcg(row_amax + row_i));
    if constexpr (kCodes) {
      const uint8_t *codes = hidden_codes(p, r);
      const uint4 *src = reinterpret_cast<const uint4 *>(codes + kb * kMxBlock);
      const uint4 lo = __ldcg(src), hi = __ldcg(src + 1);
      const uint32_t scale = __ldcg(codes + I + kb);
      const uint32_t q[kMxBlock / 4] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
      fold_store(q, scale, act_reference_exponent(amax, p.hidden_floor), hidden_block_dst(p, r, kb));
    } else {
      const float4 *src = reinterpret_cast<const float4 *>(p.h + (int64_t)r * I + kb * kMxBlock);
      float v[kMxBlock];
#pragma unroll
      for (int i = 0; i < kMxBlock / 4; ++i) {
        const float4 f = __ldcg(src + i);
        v[4 * i] = f.x; v[4 * i + 1] = f.y; v[4 * i + 2] = f.z; v[4 * i + 3] = f.w;
      }
      quantize_store(v, p.hidden_floor, act_reference_exponent(amax, p.hidden_floor), hidden_block_dst(p, r, kb));
    }
  }
}

/* The CTA that finishes a unit's last FC1 tile quantizes its h (or folds its codes) into hq and
 * releases it (not for block-scaled rows: their tiles hand their blocks over themselves).
 * Returns whether this was that tile (the marks stamp the release). */
__device__ bool publish_fc1_tile(const Params &p, const Unit &unit, const TileRef &ref, unsigned long long call) {
  const int lane = threadIdx.x & 31;
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
  if (tiles_quantize(p, unit)) finish_unit_blocks<true>(p, unit, row_amax);
  else finish_unit_blocks<false>(p, unit, row_amax);
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

/* FC2: bf16 rows to every slot that routed the token here, or for the combine (experts_combine.cuh)
 * to the row words or y. */
__device__ void store_fc2_sums(const Params &p, const float *reduce, const Unit &unit, const TileRef &ref,
                               const TileTokens &tt, unsigned long long call) {
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
      const int64_t y_row = unit.row0 + token_i; /* the token's hidden row */
      if (rows_as_words(p)) {
        unsigned long long *words = p.row_words + y_row * (H / 2) + col0 / 2;
        store_relaxed(words, row_word(call, bf16x2_bits(v[0], v[1])));
        store_relaxed(words + 1, row_word(call, bf16x2_bits(v[2], v[3])));
      } else {
        store_bf16x4(p.y + y_row * H + col0, v);
      }
    } else {
      for (uint32_t m = t_slots; m != 0; m &= m - 1)
        store_bf16x4(p.out + ((int64_t)(p.tok0 + t) * K + (__ffs(m) - 1)) * p.out_ld + col0, v);
    }
  }
}

/* Combined: each of the tile's tokens counts in at the counters of the tile's combine pieces
 * after the warp's y rows: one fence, then reductions, which nothing waits for (combine_piece
 * acquires them). A release reduction per piece (four a 256-column tile) cost a MEMBAR each:
 * +8.7 / +12.7 % at k3-tp8 / TP16 B = 2 beside v85, where one fence reads +2.5 / +3.5 % (session 48). */
__device__ void count_combine_arrivals(const Params &p, const Unit &unit, int tile) {
  const int lane = threadIdx.x & 31, pieces = p.fc2.strips * kStripRows / kMinTileCols;
  __syncwarp();
  if (lane < unit.count) {
    const int t = nth_set_bit(unit.mask, unit.first_rank + lane);
    int *count = combine_counter(p, t, tile * pieces);
    fence_acq_rel_gpu(); /* the release of the warp's y rows (the barrier above) */
    for (int i = 0; i < pieces; ++i) red_add_relaxed_gpu(count + i, 1);
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
    else store_fc2_sums(p, reduce, unit, ref, tt, call);
    KX_MARK_TILE_NS_BY_IF(lane == 0 && ref.fc1, index, kMarkTileStored);
    KX_MARK_TILE_BY_IF(lane == 0, index, kMarkTileEpilogue);
    __syncwarp();
    /* the slot is free before the hand-offs (a unit's fence, atomic and quantization): the
     * MMA warps waited for a slot 6 % of their loop at B = 64; this gave -0.7 % at B = 8 */
    if (lane == 0) mbar_arrive(&freed[e]);
    if (!ref.fc1) {
      if (p.route_weights && !rows_as_words(p)) count_combine_arrivals(p, unit, ref.tile);
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

}  // namespace
}  // namespace kx
