/* experts_producers.cuh: the experts kernel's copy streams: the weight producer and the
 * activation producers (x rows for FC1; hidden rows, or the tagged words they poll, for
 * FC2).
 * One translation unit with experts.cu, which includes its parts in order. */
#pragma once

#include "experts_ops.cuh"
#include "marks.cuh"

namespace kx {
namespace {

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

}  // namespace
}  // namespace kx
