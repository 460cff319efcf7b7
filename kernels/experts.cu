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
 *      warp when a launch has at most 32 pairs and 8 tokens) -> units of <= 8 tokens;
 *      meanwhile the MMA warps quantize their share of x to MXFP8 in scratch and a grid-wide
 *      counter says done (the activation producers wait for it before their first
 *      activation copy);
 *   2. the epilogue warps write NaN into the rows of bad ids, which no tile writes
 *      (write_nan_rows);
 *   3. FC1 tile = 2 x (16 gate + 16 up rows) of one unit over all of H; the 16 warps split K,
 *      an epilogue warp reduces in a fixed order (deterministic), applies SiTU, stores h
 *      (fp32). The CTA that finishes a unit's last FC1 tile quantizes its h to MXFP8
 *      and releases it (tagged launches, whose FC1 takes few rounds: each tile quantizes its
 *      own blocks and stores them as tagged words, which need no release);
 *   4. FC2 tile = 64, 128 or 256 output rows of one unit; an activation producer waits for
 *      the unit's hidden rows, or (tagged) the activation producers take the chunks in turn
 *      and poll the tagged words of each chunk's blocks (the weights are already on their
 *      way); bf16 results go to every slot that routed the token there (one token and one
 *      MMA warp per strip: from the MMA warps themselves). Combined output: the rows go
 *      to y and each (token, piece of columns) counts its experts in; once their tiles are
 *      done the MMA warps of the grid take the (token, piece) items in turn, wait for the
 *      count and sum the slots' rows in slot order (combine_by_counts). Launches of a few
 *      tokens store the rows as tagged words instead, which the items poll (combine_by_words),
 *      as do one-token launches whose MMA warps store the rows (in their fragment order; their
 *      items go to the CTAs that end their tiles first, one_token_cta_rank).
 *   No step cleans up: flags and counters in scratch are compared with the call's number
 *   (SyncWords), so a CTA leaves as soon as its warps are done, and any layer that
 *   shares the scratch can run next.
 * Shape limits: H % 64 == 0, I % 32 == 0, 1 <= K <= 32, E <= 4096, <= 64 tokens and
 * <= 1024 pairs per launch (the host splits larger batches into several launches).
 */
#include "experts_layout.cuh"    /* constants, warp roles, layouts, Params */
#include "experts_ops.cuh"       /* small device steps */
#include "experts_producers.cuh" /* the copy streams */
#include "experts_consumers.cuh" /* the MMA warps */
#include "experts_epilogues.cuh" /* epilogues, NaN rows, x -> MXFP8 */
#include "experts_combine.cuh"   /* the fused combine */
#include "marks.cuh"

namespace kx {
namespace {

/* ---- the kernel -------------------------------------------------------------------- */
/* CTA 0 reports a bad id of the launch (SPEC 7). */
__device__ __forceinline__ void report_bad_id(const Params &p, int pair, int id) {
  if (blockIdx.x != 0) return;
  const unsigned long long key = ((unsigned long long)(p.tok0 * p.shape.top_k + pair) << 32) | (uint32_t)id;
  atomicMax(p.fault, ~key);
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
#ifdef KX_PLACEMENT_PAD /* timing builds only (setup.py): never run, moves the code below */
    if (p.tokens < 0) {
#pragma unroll
      for (int i = 0; i < KX_PLACEMENT_PAD; ++i) asm volatile("nanosleep.u32 0;");
    }
#endif
    /* 2. the rows no tile will write */
    write_nan_rows<R::kEpilogueWarps * 32>(p, r, threadIdx.x - R::kFirstEpilogueWarp * 32);
    KX_MARK_BY_IF(threadIdx.x == R::kFirstEpilogueWarp * 32, kMarkNanDone);
    run_epilogues<kLocalX, kTagged>(p, smem, r, total_tiles, fc1_tiles, call);
  } else {
    /* 3./4. the tiles, FC1's then FC2's: MMA, then the partial sums to an epilogue warp */
    ConsumerRing<R::kEpilogueWarps> ring{smem_addr(smem + L.ring), reinterpret_cast<uint64_t *>(smem + L.full),
                                         reinterpret_cast<uint64_t *>(smem + L.empty), RingPos{}, RingPos{}};
    /* FC2's tiles start where FC1's stopped (no division, nothing held across FC1's loop) */
    /* launches of 2-16 tokens plan their combine items here; one-token launches' MMA warps have no time to
     * spare before their first stage (+2.9 / +3.4 % at k3-tp8 / TP16 B = 1 planned, session 50) */
    if (!kLocalX && p.route_weights && rows_as_words(p)) plan_word_item(p, r, smem);
    int index = blockIdx.x;
#pragma unroll 1
    for (int fc1 = 1; fc1 >= 0; --fc1) { /* one call site: the phase code is inlined once */
      index = consume_phase<kLocalX, kTagged>(p, smem, r, fc1, fc1_tiles, index, fc1 ? fc1_tiles : total_tiles, ring);
      KX_MARK(fc1 ? kMarkFc1Done : kMarkExit);
    }
    KX_MARK_NS(kMarkTilesDoneNs);
    KX_MARK(kMarkTilesDone);
    if (p.route_weights) {
      if (fc2_rows_by_mma_warps(p, kLocalX)) combine_by_words<true, false>(p, r, smem, call);
      else if (rows_as_words(p)) combine_by_words<false, !kLocalX>(p, r, smem, call);
      else combine_by_counts(p, r);
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
  return s.hidden > 0 && s.hidden % 64 == 0 && s.hidden <= KX_MOE_MAX_DIM && s.inter > 0 && s.inter % 32 == 0 &&
         s.inter <= KX_MOE_MAX_DIM && s.top_k >= 1 && s.top_k <= 32 && s.experts >= 1 && s.experts <= 4096;
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
  /* a config kx_moe_configure could have made: the grid's call words and the routing's token
   * masks and tables are sized by these bounds */
  if (!shape_ok(s) || a->fault == nullptr || a->config.grid < 1 || a->config.grid > kMaxGrid ||
      a->config.chunk_tokens < 1 || a->config.chunk_tokens > launch_tokens_for(s))
    return cudaErrorInvalidValue;
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
  p.fault = a->fault;
  p.combine_count = (int *)(scratch + S.combine_count);
  p.xq = scratch + S.xq;
  p.x_mult = (float *)(scratch + S.x_mult);
  p.h = (float *)(scratch + S.h);
  p.hq = scratch + S.hq;
  p.h_mult = (float *)(scratch + S.h_mult);
  p.handoff = (unsigned long long *)(scratch + S.handoff);
  p.row_words = (unsigned long long *)(scratch + S.row_words);
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

extern "C" cudaError_t kx_moe_read_fault(unsigned long long *word, const kx_moe_shape *shape, kx_moe_fault *fault,
                                         cudaStream_t stream) {
  *fault = kx_moe_fault{};
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
