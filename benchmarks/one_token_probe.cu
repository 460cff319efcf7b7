/* one_token_probe.cu: the skeleton of a one-token (B = 1) experts path without a ring, timed on
 * k3-tp8's bytes, to ask whether such a path could meet B = 1's bar before anyone builds it. A
 * stand-alone study (not part of the library build):
 *
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels -Ibenchmarks \
 *        benchmarks/one_token_probe.cu kernels/probe.cu -o /tmp/one_token_probe && /tmp/one_token_probe
 *
 * The path it stands for: after the wait and the routing (a spin of `start` cycles), every warp
 * loads FC1's FP4 words straight into registers (16-byte loads, strided over the grid) and does its
 * math on them (`work` instructions a vector, probe_work.cuh's work_on), while one bulk copy a CTA
 * brings the CTA's share of every routed expert's FC2 weights into shared memory. Once its FC1 is
 * done a CTA counts itself on a grid-wide counter, waits for every CTA's count (the hand-off of the
 * hidden rows, which every CTA needs), and then does the FC2 math of its share of the last expert
 * (`tail` cycles standing for SiTU, the hidden block's quantization and the row sums, then `work`
 * on each 16-byte vector of that share). A second form streams FC2 by the loads after FC1, in expert
 * order, counting after FC1 and waiting only before the last expert's FC2 (`kAfter`), so that the
 * hand-off and the tail can hide under FC2's stream. Timed as the benchmarks time a layer: a CUDA graph of 8
 * launches over 8 buffers (nothing stays in L2), programmatic dependent launch, median of replays.
 * Weights are bytes only and the math's results go nowhere: timing, not correctness. The hand-off
 * needs the whole grid resident; cases whose CTAs do not all fit are skipped.
 *
 * Session 64 (results/one-token-session64-h200.log): 1.42x by the loads alone, 1.51x with FC2 copied,
 * 1.63x with the hand-off and 1.74x with the tail (2 CTAs a SM, 4 loads in flight, work 32): above
 * the bar's 1.6 before the real decode, so this path is not built. The `after` form (calls 6-8, a
 * slower lease) reads 1.13x its own run's loads-alone row with the hand-off and the tail: ~1.54-1.61x
 * on the first lease's scale, the bar's edge.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <vector>

#include "harness.cuh"
#include "pipeline.cuh"
#include "probe_work.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kBuffers = 8;
constexpr int kExperts = 16;                      /* k3-tp8 B = 1: 16 routed experts */
constexpr int64_t kFc1Bytes = 1462272;            /* an expert's FC1: 768 x 3584 FP4 + scales */
constexpr int64_t kFc2Bytes = 731136;             /* an expert's FC2: 3584 x 384 FP4 + scales */

/* kLoads: FC2 streamed by the loads with FC1, no hand-off; kCopied: each CTA's share of FC2 copied
 * into its shared memory at the start, the FC2 math after the hand-off; kAfter: FC2 streamed by the
 * loads after FC1, every expert's but the last before the hand-off and the last expert's after it
 * (a path whose FC1 and FC2 both go in expert order, so that only the last expert's FC2 waits). */
enum Fc2 { kLoads, kCopied, kAfter };

/* Vectors [begin, end) of w, strided over the grid's threads. */
template <int kInFlight>
__device__ __forceinline__ uint32_t stream(const uint4 *w, int64_t begin, int64_t end, int work, uint32_t acc) {
  return read_with_work<kInFlight>(w, begin + blockIdx.x * (int64_t)blockDim.x + threadIdx.x, end,
                                   (int64_t)gridDim.x * blockDim.x, work, acc);
}

/* The hand-off, in two halves: the CTA counts itself once its FC1 is done (thread 0 gets the count
 * that means every CTA of this launch did: each launch adds exactly gridDim.x, since its CTAs count
 * only after its predecessor ended), and later waits for that count. */
__device__ __forceinline__ unsigned count_done(unsigned *counter) {
  __syncthreads();
  unsigned target = 0;
  if (threadIdx.x == 0) {
    __threadfence();
    target = (atomicAdd(counter, 1u) / gridDim.x + 1) * gridDim.x;
  }
  return target;
}

__device__ __forceinline__ void wait_for_grid(const unsigned *counter, unsigned target) {
  if (threadIdx.x == 0) kx::wait_count(counter, target);
  __syncthreads();
}

struct Args {
  const uint4 *w;       /* every expert's FC1, then every expert's FC2, contiguous */
  int64_t fc1_vec;      /* FC1's 16-byte vectors: FC2 starts at w + fc1_vec */
  int share;            /* bytes of FC2 a CTA holds (a multiple of 16) */
  int fc2_mode;         /* how FC2's weights come (Fc2) */
  int handoff;          /* the grid-wide count and wait before the tail */
  int start, work, tail;
  unsigned *counter;
  uint32_t *sink;
};

template <int kInFlight>
__global__ void __launch_bounds__(kThreads) one_token_skeleton(const Args a) {
  extern __shared__ __align__(128) uint4 share[];
  __shared__ uint64_t landed;
  if (threadIdx.x == 0) {
    kx::mbar_init(&landed, 1);
    kx::fence_barrier_init();
  }
  __syncthreads();
  kx::allow_dependents();
  kx::wait_for_predecessor();
  spin_cycles(a.start);
  if (a.fc2_mode == kCopied && threadIdx.x == 0) {
    kx::mbar_arrive_expect_tx(&landed, (uint32_t)a.share);
    const uint8_t *fc2 = reinterpret_cast<const uint8_t *>(a.w + a.fc1_vec);
    kx::bulk_copy_streaming(share, fc2 + (int64_t)blockIdx.x * a.share, (uint32_t)a.share, &landed,
                            kx::l2_evict_first_policy());
  }
  const int64_t end = a.fc1_vec + (int64_t)kExperts * kFc2Bytes / 16; /* the last vector of FC2, + 1 */
  uint32_t acc = 0;
  if (a.fc2_mode == kAfter) {
    const int64_t last_expert = end - kFc2Bytes / 16; /* its FC2's first vector */
    acc = stream<kInFlight>(a.w, 0, a.fc1_vec, a.work, acc);
    const unsigned target = a.handoff ? count_done(a.counter) : 0;
    acc = stream<kInFlight>(a.w, a.fc1_vec, last_expert, a.work, acc);
    /* the last expert's FC2: its first vector a thread loaded before the wait (the only one at
     * 132 x 512 threads or more), the math after it */
    const int64_t mine = last_expert + blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    const uint4 last = mine < end ? __ldcs(a.w + mine) : make_uint4(0u, 0u, 0u, 0u);
    if (a.handoff) wait_for_grid(a.counter, target);
    spin_cycles(a.tail);
    acc = work_on(acc, last, a.work);
    acc = stream<kInFlight>(a.w, last_expert + (int64_t)gridDim.x * blockDim.x, end, a.work, acc);
  } else {
    acc = stream<kInFlight>(a.w, 0, a.fc2_mode == kLoads ? end : a.fc1_vec, a.work, acc);
    if (a.fc2_mode == kLoads) spin_cycles(a.tail); /* a tail no hand-off waits for */
  }
  if (a.fc2_mode == kCopied) {
    if (a.handoff) wait_for_grid(a.counter, count_done(a.counter));
    kx::mbar_wait(&landed, 0);
    spin_cycles(a.tail);
    /* the FC2 math of this CTA's share of the last expert */
    const int my_last = (int)(kFc2Bytes / gridDim.x / 16);
    for (int v = threadIdx.x; v < my_last; v += blockDim.x)
      acc = work_on(acc, share[a.share / 16 - my_last + v], a.work);
  }
  if (acc == 0x9e3779b9u) *a.sink = acc; /* practically never taken; keeps the loads */
}

struct Case {
  int ctas_per_sm, in_flight, fc2_mode, handoff, start, work, tail;
};

}  // namespace

int main() {
  const StreamProbe probe;
  const int sms = probe.sms;
  const cudaStream_t s = probe.s;
  const double floor_TBps = probe.floor_TBps;
  const int64_t fc1 = kExperts * kFc1Bytes, bytes = kExperts * (kFc1Bytes + kFc2Bytes);
  const double floor_us = (double)bytes / (floor_TBps * 1e12) * 1e6;
  std::vector<Dev *> bufs;
  for (int b = 0; b < kBuffers; ++b) {
    bufs.push_back(new Dev((size_t)bytes));
    CHECK(cudaMemset(bufs.back()->p, 1 + b, (size_t)bytes));
  }
  Dev sink(64), counter(sizeof(unsigned));
  CHECK(cudaMemset(counter.p, 0, sizeof(unsigned)));
  printf("%d SMs; HBM read over 4 GiB: %.3f TB/s; k3-tp8 B = 1: %.1f MB (FC1 %.1f), floor %.2f us\n", sms, floor_TBps,
         bytes / 1e6, fc1 / 1e6, floor_us);
  printf("8 launches a graph after a wait; CTAs of %d threads\n", kThreads);
  printf("  %-6s %-9s %-8s %-7s %5s %4s %5s -> %7s %6s\n", "CTA/SM", "in flight", "FC2", "handoff", "start", "work",
         "tail", "us", "x floor");
  std::vector<Case> cases;
  for (int cps : {1, 2, 4})
    for (int inf : {4, 8})
      for (int work : {32, 64}) {
        cases.push_back({cps, inf, kLoads, 0, 2000, work, 0});     /* all by loads: small_read_probe's case */
        cases.push_back({cps, inf, kLoads, 0, 2000, work, 1500});  /* + a tail at the end */
        cases.push_back({cps, inf, kCopied, 0, 2000, work, 0});    /* FC2 copied into shared memory */
        cases.push_back({cps, inf, kCopied, 1, 2000, work, 0});    /* + the hand-off */
        cases.push_back({cps, inf, kCopied, 1, 2000, work, 1500}); /* + SiTU, quantization, row sums */
        cases.push_back({cps, inf, kAfter, 0, 2000, work, 0});     /* FC2 after FC1, no hand-off */
        cases.push_back({cps, inf, kAfter, 1, 2000, work, 0});     /* + the last expert waits for it */
        cases.push_back({cps, inf, kAfter, 1, 2000, work, 1500});
      }
  for (const Case &c : cases) {
    const unsigned grid = (unsigned)(c.ctas_per_sm * sms);
    const int share = c.fc2_mode == kCopied ? (int)(kExperts * kFc2Bytes / grid / 16 * 16) : 0;
    auto kernel = c.in_flight == 4 ? one_token_skeleton<4> : one_token_skeleton<8>;
    CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, share));
    int resident = 0; /* the hand-off waits for every CTA: the whole grid must be resident at once */
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, (size_t)share));
    if (c.handoff && resident < c.ctas_per_sm) {
      printf("  %-6d %-9d skipped: %d CTAs a SM resident, the hand-off would wait for CTAs never started\n",
             c.ctas_per_sm, c.in_flight, resident);
      continue;
    }
    const float us = graph_us(s, [&] {
      for (int b = 0; b < kBuffers; ++b) {
        const Args a{bufs[b]->as<const uint4>(), fc1 / 16, share, c.fc2_mode, c.handoff,
                     c.start, c.work, c.tail, counter.as<unsigned>(), sink.as<uint32_t>()};
        const ChainedLaunch l(true, grid, kThreads, (size_t)share, 1, s);
        CHECK(cudaLaunchKernelEx(&l.cfg, kernel, a));
      }
    }) / kBuffers;
    printf("  %-6d %-9d %-8s %-7s %5d %4d %5d -> %7.2f %6.3f\n", c.ctas_per_sm, c.in_flight,
           c.fc2_mode == kLoads ? "loads" : c.fc2_mode == kCopied ? "copied" : "after", c.handoff ? "yes" : "no", c.start, c.work, c.tail, us, us / floor_us);
    fflush(stdout); /* a run cut short keeps what it measured */
  }
  for (Dev *d : bufs) delete d;
  return 0;
}
