/* handoff_latency.cu: how long a word that one SM stores takes to be seen by another SM while
 * the others stream from HBM, as in the experts kernel's one-token hand-off (an FC1 epilogue
 * stores tagged words, FC2's activation warps poll them). A stand-alone study, not part of the
 * library build:
 *
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels benchmarks/handoff_latency.cu \
 *        -o /tmp/handoff_latency && /tmp/handoff_latency
 *
 * One CTA per SM. Warp 0 streams the CTA's share of a 2 GiB buffer through a ring of `stages`
 * 17 KB bulk copies (evict-first, as the kernel's weight warp does) and warp 1 releases each
 * stage as soon as it is full. Lane 0 of warp 2 of every 4th CTA first times a chain of
 * dependent loads of an L2-resident array (one round trip each), then polls a flag word; lane 0
 * of CTA 0's warp 2 stores round r = 1..kRounds to it every 3 us, stamping %globaltimer just
 * before each store, and the pollers stamp the first sight of each round. A poller keeps one
 * load in flight, or two, the second issued half a round trip after the first. Prints, per
 * configuration, the store -> seen latency over all rounds and pollers (median, 90th
 * percentile, largest), the round trip (median over pollers) and the streamed rate.
 */
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

#include "harness.cuh"
#include "pipeline.cuh"

namespace {

constexpr int kChunk = 17408; /* the experts kernel's weight chunk */
constexpr int kMaxStages = 8;
constexpr int kRounds = 48;
constexpr int kRoundNs = 3000;
constexpr int kChase = 32;         /* dependent loads per round-trip sample */
constexpr int kChaseWords = 1024;  /* 4 KB: L2-resident */
constexpr int kPollEvery = 4;      /* CTAs 4, 8, ... poll */
constexpr int kChunksPerCta = 900; /* ~2 GB over 132 SMs: longer than the rounds at 4.5 TB/s */
constexpr int kThreads = 96;
constexpr int kSmem = kMaxStages * kChunk + 2 * kMaxStages * 8;

struct Config {
  const char *name;
  int stream, stages, in_flight;
};

struct Buffers {
  const uint8_t *stream;
  size_t stream_chunks;
  unsigned long long *flag;
  const unsigned int *chase;
  unsigned long long *stored; /* [kRounds + 1], the writer's stamps */
  unsigned long long *seen;   /* [grid][kRounds + 1], each poller's first sights */
  unsigned long long *rtt_ns; /* [grid], each poller's round trip */
};

__device__ void stream_chunks(const Buffers &b, uint8_t *smem, uint64_t *full, uint64_t *empty, int stages) {
  const uint64_t policy = kx::l2_evict_first_policy();
  kx::RingPos pos;
  for (int i = 0; i < kChunksPerCta; ++i, pos.advance(stages)) {
    kx::mbar_wait(&empty[pos.stage], pos.parity ^ 1);
    if ((threadIdx.x & 31) == 0) {
      kx::mbar_arrive_expect_tx(&full[pos.stage], kChunk);
      const size_t c = ((size_t)blockIdx.x + (size_t)i * gridDim.x) % b.stream_chunks;
      kx::bulk_copy_streaming(smem + pos.stage * kChunk, b.stream + c * kChunk, kChunk, &full[pos.stage], policy);
    }
    __syncwarp();
  }
}

__device__ void release_chunks(uint64_t *full, uint64_t *empty, int stages) {
  kx::RingPos pos;
  for (int i = 0; i < kChunksPerCta; ++i, pos.advance(stages)) {
    kx::mbar_wait(&full[pos.stage], pos.parity);
    if ((threadIdx.x & 31) == 0) kx::mbar_arrive(&empty[pos.stage]);
    __syncwarp();
  }
}

/* Rounds up to v seen now. */
__device__ __forceinline__ void record(unsigned long long v, int &next, unsigned long long *seen) {
  const unsigned long long t = kx::global_ns();
  for (; next <= kRounds && (unsigned long long)next <= v; ++next) seen[next] = t;
}

__device__ void poll(const Buffers &b, int in_flight) {
  /* the round trip first: a chain of dependent loads */
  unsigned int at = blockIdx.x % kChaseWords;
  const unsigned long long t0 = kx::global_ns();
  for (int i = 0; i < kChase; ++i) at = kx::load_relaxed(b.chase + at);
  const unsigned long long rtt = (kx::global_ns() - t0) / kChase;
  b.rtt_ns[blockIdx.x] = rtt + (at == 0xFFFFFFFFu); /* uses the chain's end, so it is not dropped */
  unsigned long long *seen = b.seen + (size_t)blockIdx.x * (kRounds + 1);
  int next = 1;
  unsigned long long a = kx::load_relaxed(b.flag);
  while (next <= kRounds) {
    if (in_flight == 2) {
      __nanosleep((unsigned)rtt / 2);
      const unsigned long long second = kx::load_relaxed(b.flag);
      record(a, next, seen);
      __nanosleep((unsigned)rtt / 2);
      a = kx::load_relaxed(b.flag);
      record(second, next, seen);
    } else {
      record(a, next, seen);
      a = kx::load_relaxed(b.flag);
    }
  }
}

__device__ void write_rounds(const Buffers &b) {
  const unsigned long long start = kx::global_ns() + 100000; /* after the pollers' round trips, streaming steady */
  while (kx::global_ns() < start) {
  }
  for (int r = 1; r <= kRounds; ++r) {
    const unsigned long long t = kx::global_ns();
    b.stored[r] = t;
    kx::store_relaxed(b.flag, (unsigned long long)r);
    while (kx::global_ns() < t + kRoundNs) {
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) handoff_kernel(Buffers b, int stream, int stages, int in_flight) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t *full = reinterpret_cast<uint64_t *>(smem + kMaxStages * kChunk), *empty = full + kMaxStages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      kx::mbar_init(&full[s], 1);
      kx::mbar_init(&empty[s], 1);
    }
    kx::fence_barrier_init();
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  if (warp == 0 && stream) stream_chunks(b, smem, full, empty, stages);
  else if (warp == 1 && stream) release_chunks(full, empty, stages);
  else if (warp == 2 && threadIdx.x % 32 == 0) {
    if (blockIdx.x == 0) write_rounds(b);
    else if (blockIdx.x % kPollEvery == 0) poll(b, in_flight);
  }
}

}  // namespace

int main() {
  int grid = 0;
  CHECK(cudaDeviceGetAttribute(&grid, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaFuncSetAttribute(handoff_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  const size_t stream_bytes = (size_t)2 << 30, stream_chunks = stream_bytes / kChunk;
  Dev stream(stream_bytes), flag(8), chase(4 * kChaseWords), stored(8 * (kRounds + 1)),
      seen(8 * (size_t)grid * (kRounds + 1)), rtt(8 * (size_t)grid);
  CHECK(cudaMemset(stream.p, 1, stream_bytes));
  std::vector<unsigned int> next(kChaseWords);
  for (int i = 0; i < kChaseWords; ++i) next[i] = (i + 97) % kChaseWords; /* 97: a new line each step */
  CHECK(cudaMemcpy(chase.p, next.data(), 4 * kChaseWords, cudaMemcpyHostToDevice));
  const Buffers b{stream.as<uint8_t>(), stream_chunks,         flag.as<unsigned long long>(),
                  chase.as<unsigned int>(), stored.as<unsigned long long>(), seen.as<unsigned long long>(),
                  rtt.as<unsigned long long>()};
  const Config configs[] = {{"idle, 1 load", 0, 4, 1},          {"streaming 4 stages, 1 load", 1, 4, 1},
                            {"streaming 4 stages, 2 loads", 1, 4, 2}, {"streaming 2 stages, 1 load", 1, 2, 1},
                            {"streaming 8 stages, 1 load", 1, 8, 1}};
  printf("store -> seen (us): median / p90 / max over %d rounds x %d pollers; round trip (us); streamed TB/s\n",
         kRounds, (grid - 1) / kPollEvery);
  for (const Config &c : configs) {
    CHECK(cudaMemset(flag.p, 0, 8));
    CHECK(cudaMemset(seen.p, 0, 8 * (size_t)grid * (kRounds + 1)));
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    CHECK(cudaEventRecord(e0));
    handoff_kernel<<<grid, kThreads, kSmem>>>(b, c.stream, c.stages, c.in_flight);
    CHECK(cudaGetLastError());
    CHECK(cudaEventRecord(e1));
    CHECK(cudaDeviceSynchronize());
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    std::vector<unsigned long long> st(kRounds + 1), se((size_t)grid * (kRounds + 1)), rt(grid);
    CHECK(cudaMemcpy(st.data(), stored.p, 8 * st.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(se.data(), seen.p, 8 * se.size(), cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(rt.data(), rtt.p, 8 * rt.size(), cudaMemcpyDeviceToHost));
    std::vector<float> lat, trips;
    for (int cta = kPollEvery; cta < grid; cta += kPollEvery) {
      trips.push_back(rt[cta] / 1000.0f);
      for (int r = 1; r <= kRounds; ++r)
        lat.push_back((long long)(se[(size_t)cta * (kRounds + 1) + r] - st[r]) / 1000.0f);
    }
    const double streamed = c.stream ? (double)grid * kChunksPerCta * kChunk / (ms * 1e-3) / 1e12 : 0.0;
    printf("%-30s %6.2f / %6.2f / %6.2f   %5.2f   %5.2f (over the whole launch)\n", c.name, percentile(lat, 0.5),
           percentile(lat, 0.9), percentile(lat, 1.0), percentile(trips, 0.5), streamed);
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
  }
  return 0;
}
