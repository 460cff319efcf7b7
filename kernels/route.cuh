/* route.cuh: per-CTA routing of one launch's (token, slot) pairs (SPEC 3, 7).
 *
 * Every CTA reads the ids (at most 1024 pairs, L2-resident) and builds the same tables
 * in its own shared memory, so no routing kernel and no grid-wide barrier is needed
 * before weights can stream (a separate routing launch costs more than the whole B=1
 * floor). A group of kRouteThreads threads routes and syncs on its own named barrier,
 * so the rest of the CTA can do other work meanwhile; `tid` is a thread's index in it.
 * A launch of at most 32 pairs and 8 tokens (B = 1, 2 at K = 16) is routed by one warp of
 * the group instead, with warp votes and no barrier (route_one_warp), into the same tables.
 * Everything is deterministic: the expert order is the order of first appearance in
 * the pairs, and the tokens of an expert are in ascending token order (a 64-bit token
 * mask per expert), so all CTAs agree on every row index.
 *
 *   pair_expert[p]     expert of pair p = t * K + j, or -1 for an id outside [0, E)
 *   expert_slot[e]     compact index c of expert e (first its first pair, see below)
 *   expert_id[c], token_mask[c]
 *   expert_scan[c]     (first hidden row << 16) | first unit   (exclusive prefix sums)
 *   unit_expert[u], unit_group[u]: unit u = tokens 8g..8g+7 of expert c
 *   token_experts[t]   distinct valid experts of token t; token_bad[t]: t has a bad id
 *   unit_pairs[u]      one-warp routing only: the pairs (lanes) routed to unit u's expert, so
 *                      a one-token launch's unit has its slots in one load
 * A token that repeats an expert in several slots is computed once (one hidden row);
 * the output is written to each of those slots.
 */
#pragma once

#include <stdint.h>

#include "moe_layout.cuh"
#include "pipeline.cuh"

namespace kx {

/* the experts kernel's warps that are not MMA warps (checked in experts_layout.cuh) */
constexpr int kRouteWarps = 8;
constexpr int kRouteThreads = kRouteWarps * 32;
/* named barrier id (0: __syncthreads, 1: the MMA warps', experts_layout.cuh) */
constexpr int kRouteBarrier = 2;
constexpr int kMaxPairs = 1024;
constexpr int kMaxLaunchTokens = 64; /* token masks are 64-bit */
constexpr int kGroupTokens = 8;      /* tokens per unit: one MMA n-tile */
constexpr uint32_t kNoPair = 0xFFFFFFFFu;

KX_HOST_DEVICE constexpr int max_units_for(int pairs) { return pairs + pairs / kGroupTokens + 1; }

struct Routing {
  int16_t *pair_expert;
  uint32_t *expert_slot;
  unsigned long long *token_mask;
  uint16_t *expert_id;
  int *expert_scan;
  uint16_t *unit_expert;
  uint8_t *unit_group;
  int *token_experts;
  int *token_bad;
  uint32_t *chunk_mask;
  int *scan_tmp;
  int *totals; /* [0] experts, [1] units, [2] hidden rows */
  uint32_t *unit_pairs;
};

/* Tokens of unit u, its expert and where its hidden rows start. */
struct Unit {
  int expert;      /* global expert id */
  int count;       /* tokens in this unit, 1..8 */
  int first_rank;  /* rank of its first token within the expert: 8 * group */
  int row0;        /* hidden row of its first token */
  unsigned long long mask;
};

__device__ __forceinline__ Unit unit_info(const Routing &r, int u) {
  Unit x;
  const int c = r.unit_expert[u];
  x.expert = r.expert_id[c];
  x.mask = r.token_mask[c];
  x.first_rank = kGroupTokens * r.unit_group[u];
  int n = __popcll(x.mask) - x.first_rank;
  x.count = n < kGroupTokens ? n : kGroupTokens;
  x.row0 = (r.expert_scan[c] >> 16) + x.first_rank;
  return x;
}

/* Position of the n-th set bit (n counted from 0) of mask. */
__device__ __forceinline__ int nth_set_bit(unsigned long long mask, int n) {
  for (int i = 0; i < n; ++i) mask &= mask - 1;
  return __ffsll((long long)mask) - 1;
}

/* The slots of token t (a mask over its K) that routed it to expert e. */
__device__ __forceinline__ uint32_t routed_slots(const Routing &r, int t, int K, int e) {
  uint32_t slots = 0;
  for (int j = 0; j < K; ++j) slots |= (uint32_t)(r.pair_expert[t * K + j] == e) << j;
  return slots;
}

/* Hidden row of (token t, compact expert c). */
__device__ __forceinline__ int hidden_row(const Routing &r, int c, int t) {
  unsigned long long below = (t == 0) ? 0ull : (r.token_mask[c] & ((1ull << t) - 1));
  return (r.expert_scan[c] >> 16) + __popcll(below);
}

__device__ __forceinline__ void route_sync() { named_barrier(kRouteBarrier, kRouteThreads); }

/* In-place exclusive prefix sum of v[0..n) by the routing group; returns the total. */
__device__ int group_exclusive_scan(int *v, int n, int *warp_tmp, int tid) {
  const int lane = tid & 31, warp = tid >> 5;
  const int per = (n + kRouteThreads - 1) / kRouteThreads;
  const int begin = min(tid * per, n), end = min(begin + per, n);
  int local = 0;
  for (int i = begin; i < end; ++i) local += v[i];
  int incl = local;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    int other = __shfl_up_sync(0xFFFFFFFFu, incl, d);
    if (lane >= d) incl += other;
  }
  if (lane == 31) warp_tmp[warp] = incl;
  route_sync();
  if (tid == 0) {
    int run = 0;
    for (int w = 0; w < kRouteWarps; ++w) { int s = warp_tmp[w]; warp_tmp[w] = run; run += s; }
    warp_tmp[31] = run;
  }
  route_sync();
  int run = warp_tmp[warp] + incl - local;
  for (int i = begin; i < end; ++i) { int s = v[i]; v[i] = run; run += s; }
  int total = warp_tmp[31];
  route_sync();
  return total;
}

/* Before the predecessor wait: clear what the atomics below build on. */
__device__ void routing_clear(const Routing &r, int experts, int tid) {
  for (int e = tid; e < experts; e += kRouteThreads) r.expert_slot[e] = kNoPair;
  for (int t = tid; t < kMaxLaunchTokens; t += kRouteThreads) {
    r.token_experts[t] = 0;
    r.token_bad[t] = 0;
  }
}

/* Whether route_one_warp can route a launch: every pair a lane, every expert one unit. */
__device__ __forceinline__ bool one_warp_routes(int tokens, int top_k) {
  return tokens * top_k <= 32 && tokens <= kGroupTokens;
}

/* The same tables as route_pairs for a launch one_warp_routes, by one warp (lane p: pair
 * p) with no group barrier: the general path's seven barriers and shared atomics took
 * ~4 kcycles of B = 1's start, before which no weight can stream. */
template <typename ReportBad>
__device__ void route_one_warp(const Routing &r, const int32_t *ids, int64_t ids_ld, int tokens, int top_k,
                               int experts, int lane, ReportBad report_bad) {
  const int pairs = tokens * top_k;
  const bool live = lane < pairs;
  int t = 0; /* the lane's token, lane / top_k, by compares (tokens <= kGroupTokens): no division before the load */
  for (int u = 1; u < tokens; ++u) t += lane >= u * top_k;
  const int id = live ? ids[t * ids_ld + lane - t * top_k] : -1;
  const bool valid = live && id >= 0 && id < experts;
  const uint32_t slot_bits = top_k == 32 ? 0xFFFFFFFFu : (1u << top_k) - 1;
  const auto lanes_of = [&](int u) { return slot_bits << u * top_k; }; /* token u's pairs */
  const uint32_t below = (1u << lane) - 1;
  /* the lanes that hold the same expert; every other lane is a group of its own. Each lane's
   * key from a shuffle: __match_any_sync took ~0.5 kcycles here (32 distinct keys; session 34) */
  const int key = valid ? id : -1 - lane;
  uint32_t same = 0;
#pragma unroll
  for (int j = 0; j < 32; ++j) same |= (uint32_t)(__shfl_sync(0xFFFFFFFFu, key, j) == key) << j;
  const bool first = valid && !(same & below); /* first appearance: the compact order */
  const uint32_t firsts = __ballot_sync(0xFFFFFFFFu, first);
  const uint32_t token_firsts = __ballot_sync(0xFFFFFFFFu, valid && !(same & below & lanes_of(t)));
  const uint32_t bad = __ballot_sync(0xFFFFFFFFu, live && !valid);
  if (live) {
    r.pair_expert[lane] = valid ? (int16_t)id : (int16_t)-1;
    if (!valid) report_bad(lane, id);
  }
  unsigned long long mask = 0; /* the expert's tokens */
  for (int u = 0; u < tokens; ++u)
    if (same & lanes_of(u)) mask |= 1ull << u;
  const int rows = first ? __popcll(mask) : 0;
  /* hidden rows of the experts up to this lane's: rows <= kGroupTokens, a ballot per bit
   * instead of a chain of shuffles */
  static_assert(kGroupTokens < 16, "rows fit 4 bits");
  const uint32_t through = below | (1u << lane);
  int rows_through = 0;
#pragma unroll
  for (int b = 0; b < 4; ++b) rows_through += __popc(__ballot_sync(0xFFFFFFFFu, (rows >> b) & 1) & through) << b;
  if (first) {
    const int c = __popc(firsts & below);
    r.expert_slot[id] = (uint32_t)c;
    r.expert_id[c] = (uint16_t)id;
    r.token_mask[c] = mask;
    r.expert_scan[c] = ((rows_through - rows) << 16) | c;
    r.unit_expert[c] = (uint16_t)c;
    r.unit_group[c] = 0;
    r.unit_pairs[c] = same;
  }
  if (lane < tokens) {
    r.token_experts[lane] = __popc(token_firsts & lanes_of(lane));
    r.token_bad[lane] = (bad & lanes_of(lane)) != 0;
  }
  if (lane == 31) {
    r.totals[0] = r.totals[1] = __popc(firsts);
    r.totals[2] = rows_through;
  }
}

/* Pair p's token, p / top_k without a division: p < kMaxPairs = 2^10 and top_k <= 32, so
 * p * ceil(2^16 / top_k) >> 16 is exact (the rounding adds less than p / 2^16 < 1 / top_k). */
__device__ __forceinline__ uint32_t pair_token_multiplier(int top_k) { return (65536u + top_k - 1) / top_k; }
__device__ __forceinline__ int pair_token(int p, uint32_t multiplier) { return (int)((p * multiplier) >> 16); }
constexpr int kPairsPerRouteThread = kMaxPairs / kRouteThreads;
static_assert(kPairsPerRouteThread * kRouteThreads == kMaxPairs, "every pair has a thread");

/* Builds the tables from ids rows tok0.. tok0+tokens-1. Bad ids are reported through
 * report_bad(pair index within this launch, id) by CTA 0 only. */
template <typename ReportBad>
__device__ void route_pairs(const Routing &r, const int32_t *ids, int64_t ids_ld, int tokens,
                            int top_k, int experts, int tid, ReportBad report_bad) {
  const int lane = tid & 31, warp = tid >> 5;
  const int pairs = tokens * top_k;
  const uint32_t to_token = pair_token_multiplier(top_k);

  /* every id of this thread's pairs requested before any is used: one round trip, not one per pair */
  int id[kPairsPerRouteThread];
#pragma unroll
  for (int i = 0; i < kPairsPerRouteThread; ++i) {
    const int p = tid + i * kRouteThreads, t = pair_token(p, to_token);
    id[i] = p < pairs ? ids[t * ids_ld + p - t * top_k] : 0;
  }
#pragma unroll
  for (int i = 0; i < kPairsPerRouteThread; ++i) {
    const int p = tid + i * kRouteThreads;
    if (p >= pairs) break;
    const bool valid = id[i] >= 0 && id[i] < experts;
    r.pair_expert[p] = valid ? (int16_t)id[i] : (int16_t)-1;
    if (valid) {
      atomicMin(&r.expert_slot[id[i]], (uint32_t)p);
    } else {
      r.token_bad[pair_token(p, to_token)] = 1;
      report_bad(p, id[i]);
    }
  }
  route_sync();

  /* first pairs of each expert, in pair order: one ballot per 32 pairs */
  const int chunks = (pairs + 31) / 32;
  for (int ch = warp; ch < chunks; ch += kRouteWarps) {
    const int p = ch * 32 + lane;
    const int e = p < pairs ? r.pair_expert[p] : -1;
    const bool first = e >= 0 && r.expert_slot[e] == (uint32_t)p;
    const uint32_t mask = __ballot_sync(0xFFFFFFFFu, first);
    if (lane == 0) r.chunk_mask[ch] = mask;
  }
  route_sync();
  if (warp == 0) {
    const int count = lane < chunks ? __popc(r.chunk_mask[lane]) : 0;
    int incl = count;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      int other = __shfl_up_sync(0xFFFFFFFFu, incl, d);
      if (lane >= d) incl += other;
    }
    r.scan_tmp[lane] = incl - count;
    if (lane == 31) r.totals[0] = incl;
  }
  route_sync();
  for (int p = tid; p < pairs; p += kRouteThreads) {
    const uint32_t mask = r.chunk_mask[p / 32], bit = 1u << (p % 32);
    if (mask & bit) {
      const int c = r.scan_tmp[p / 32] + __popc(mask & (bit - 1));
      const int e = r.pair_expert[p];
      r.expert_id[c] = (uint16_t)e;
      r.token_mask[c] = 0ull;
      r.expert_slot[e] = (uint32_t)c; /* from here on: the compact index */
    }
  }
  route_sync();

  for (int p = tid; p < pairs; p += kRouteThreads) {
    const int e = r.pair_expert[p];
    if (e < 0) continue;
    /* token t's bit sits in one 32-bit half of the mask: a native shared atomic (a 64-bit
     * OR is a compare-and-swap loop); the bit it finds already set marks a repeat of this
     * expert in another slot of the token, so no scan of the token's slots is needed */
    const int t = pair_token(p, to_token);
    uint32_t *half = reinterpret_cast<uint32_t *>(&r.token_mask[r.expert_slot[e]]) + (t >> 5);
    const uint32_t bit = 1u << (t & 31);
    if (!(atomicOr(half, bit) & bit)) atomicAdd(&r.token_experts[t], 1);
  }
  route_sync();

  const int n_experts = r.totals[0];
  for (int c = tid; c < n_experts; c += kRouteThreads) {
    const int n = __popcll(r.token_mask[c]);
    r.expert_scan[c] = (n << 16) | ((n + kGroupTokens - 1) / kGroupTokens);
  }
  route_sync();
  const int packed_total = group_exclusive_scan(r.expert_scan, n_experts, r.scan_tmp, tid);
  if (tid == 0) {
    r.totals[1] = packed_total & 0xFFFF;
    r.totals[2] = packed_total >> 16;
  }
  for (int c = tid; c < n_experts; c += kRouteThreads) {
    const int first_unit = r.expert_scan[c] & 0xFFFF;
    const int units = (__popcll(r.token_mask[c]) + kGroupTokens - 1) / kGroupTokens;
    for (int g = 0; g < units; ++g) {
      r.unit_expert[first_unit + g] = (uint16_t)c;
      r.unit_group[first_unit + g] = (uint8_t)g;
    }
  }
  route_sync();
}

}  // namespace kx
