/* experts_consumers.cuh: the experts kernel's MMA warps: each stage's FP4 decode and MMAs
 * over a phase's tiles, and the hand-off of their partial sums to the epilogue warps.
 * One translation unit with experts.cu, which includes its parts in order. */
#pragma once

#include "experts_ops.cuh"
#include "marks.cuh"

namespace kx {
namespace {

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

/* A unit's two weight scales from its 2-byte pair (row g's byte low, row g + 8's high) as factors:
 * row g's byte lands on the exponent, row g + 8's low bit on the sign, which the FFMAs drop
 * (|operand|): one shift, no mask. */
__device__ __forceinline__ float2 unit_weight_scales(uint32_t pair) {
  return make_float2(fabsf(__uint_as_float(pair << 23)), e8m0_to_float_nonzero(pair >> 8));
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
      const float2 ws = unit_weight_scales(sw[j]); /* rows g and g + 8 */
      uint32_t a_lo[4], a_hi[4];
      decode_fp4x8(w[j].x, a_lo);
      decode_fp4x8(w[j].y, a_hi);
      float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      mma_f16(d, a_lo, b[j].x, b[j].y);
      mma_f16(d, a_hi, b[j].z, b[j].w);
      if (kPartial && j >= units) continue;
      sums[0] = fmaf(d[0], ws.x, sums[0]);
      sums[2] = fmaf(d[2], ws.y, sums[2]);
      if constexpr (!kOneToken) { /* one token: column 0 alone is ever read */
        sums[1] = fmaf(d[1], ws.x, sums[1]);
        sums[3] = fmaf(d[3], ws.y, sums[3]);
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

/* What one MMA warp does in every tile of a phase, fixed once per phase: 16 warps over 4,
 * 8 or 16 strips (shifts, no divisions), the units of its full chunks and of a shorter
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
 * strip: no partial sums to add): to each of the token's slots in the mask `where`, or,
 * combined, as hidden row `where`'s tagged row words. Lanes t = 0 hold MMA column 0 (the
 * token): rows g and g + 8. The values are store_fc2_sums' bit for bit (0 + sum, times the row
 * multiplier). */
__device__ __forceinline__ void store_token_rows(const Params &p, int tile, uint32_t where, const float (&acc)[4],
                                                 unsigned long long call) {
  const int lane = threadIdx.x & 31, K = p.shape.top_k, strip = tile * kConsumerWarps + (int)(threadIdx.x >> 5);
  if (lane & 3) return;
  const int col = strip * kStripRows + (lane >> 2);
  const float mult = row_multiplier(0), row_g = (0.0f + acc[0]) * mult, row_g8 = (0.0f + acc[2]) * mult;
  if (p.route_weights) {
    store_relaxed(p.row_words + (int64_t)where * (p.shape.hidden / 2) + strip * 8 + (lane >> 2),
                  row_word(call, bf16x2_bits(row_g, row_g8)));
    return;
  }
  const __nv_bfloat16 lo = __float2bfloat16_rn(row_g), hi = __float2bfloat16_rn(row_g8);
  for (uint32_t m = where; m != 0; m &= m - 1) {
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
    /* where the launch's one token's rows go, before the chunks: off the tail. One token routes
     * in one warp, so unit u is compact expert u and its pairs are the token's slots (a scan of
     * the K slots here, on all 16 MMA warps at once, took B = 1's MMA warps ~0.7 kcycles a tile);
     * combined, its hidden row */
    const int unit = direct ? p.fc2.per_tiles(index - cp.fc1_tiles) : 0;
    const int tile = index - cp.fc1_tiles - unit * p.fc2.tiles;
    const uint32_t where = !direct ? 0 : p.route_weights ? (uint32_t)hidden_row(r, unit, 0) : r.unit_pairs[unit];
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
    if (direct) store_token_rows(p, tile, where, acc, *reinterpret_cast<const unsigned long long *>(smem + p.smem.call));
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

}  // namespace
}  // namespace kx
