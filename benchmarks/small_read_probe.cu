/* small_read_probe.cu: the least time a chain of launches takes to read S bytes each from HBM,
 * for the sizes a decode layer reads, against the 4 GiB read that every floor is quoted from, and
 * what a layer's start and per-chunk work cost on top of such a stream. A stand-alone study (not
 * part of the library build):
 *
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels -Ibenchmarks \
 *        benchmarks/small_read_probe.cu kernels/probe.cu -o /tmp/small_read_probe && /tmp/small_read_probe
 *
 * (`--quick` skips the larger cases; `--loads-work` times only B = 1's bytes by plain loads with a start spin
 * and math on each vector, beside the ring with the kernel's start and pace.) Why: the bars are ratios to bytes / (the 4 GiB read's
 * bandwidth). A 35 MB layer (k3-tp8 B = 1) or a 59 MB GEMM (WsGemm N = 4096, K = 7168) pays the
 * launch, the first requests' latency and the last SMs' tail on top of its bytes, whatever its
 * kernel does. This probe asks what a kernel that does nothing but read its bytes pays, in the
 * benchmarks' method: a CUDA graph of `rounds` x 8 launches over 8 buffers (rotated, so nothing
 * stays in L2), median of 60 replays.
 *
 * Readers: plain loads (16-byte loads, `kInFlight` per thread before the first use, grid-stride as
 * kx_probe_read or each CTA its own slice, ctas_per_sm x SMs CTAs of 512 threads), or the experts
 * kernel's ring (chained_ring: one CTA per SM, one producer lane's bulk copies, sliced / strided /
 * claimed deals, spins standing for the routing and the MMA warps). Three ways to follow the
 * previous launch:
 *   wait    programmatic dependent launch, griddepcontrol.wait before the first load (a layer
 *           whose addresses come from its predecessor: the experts kernel's routed experts);
 *   early   programmatic dependent launch, no wait (bytes the predecessor does not write: a
 *           weight-stationary GEMM's weights; the launch still needs SMs the predecessor frees);
 *   serial  no programmatic launch (plain stream order).
 * Prints per size the best case of each way and reader, every case, then B = 1's bytes through the
 * ring with spins (and first waves smaller than the ring), one stamped replay of some of those, and
 * B = 1 as 16 experts of 384-expert layers.
 *
 * Session 42 (results/small-read-session42-h200.log, nine leases): after a wait, B = 1's 35.1 MB
 * read 1.19-1.22x the floor as plain loads and 1.20-1.31x through the ring (8 launches a graph;
 * session 36's skeleton, 1.51-1.54x, was not the bytes' own cost); a 2000-cycle start adds ~1.0 us
 * and 720 cycles a 16 KB chunk 2.0-2.7 us (sliced deal; 1.5-2.1 strided), more with deeper rings:
 * a CTA whose first stage lands late carries the delay to its end once it has work per chunk, and a
 * smaller first wave does not help. Pairs (clusters of 2) and experts spread over an 842 MB layer
 * change nothing. 58.7 MB: 1.00-1.03x early, 1.10-1.15x after a wait.
 *
 * Session 64 (results/small-read-session64-h200.log): with a 2000-cycle start, plain loads at 2-4 CTAs of
 * 512 threads a SM and ~30 instructions of math a vector read 1.41x, where the ring with the kernel's
 * 720-cycle pace reads 1.70x: warps that wait on no one hide the math a ring's stage exposes.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <algorithm>
#include <string>
#include <vector>

#include "harness.cuh"
#include "pipeline.cuh"
#include "probe_work.cuh"

namespace {

constexpr int kThreads = 512;
constexpr int kBuffers = 8;

enum class Follow { kWait, kEarly, kSerial };
const char *follow_name(Follow f) { return f == Follow::kWait ? "wait" : f == Follow::kEarly ? "early" : "serial"; }

/* sliced: CTA c reads its own contiguous slice [c n / grid, (c + 1) n / grid), as the experts
 * kernel's CTAs read their items; else the whole grid strides over the buffer. start_cycles: a spin
 * after the wait (a layer's routing); work: instructions on each vector (work_on). */
template <int kInFlight>
__global__ void __launch_bounds__(kThreads) chained_read(const uint4 *data, int64_t n_vec, uint32_t *sink,
                                                        int wait_first, int sliced, int start_cycles, int work) {
  kx::allow_dependents();
  if (wait_first) kx::wait_for_predecessor();
  spin_cycles(start_cycles);
  uint32_t acc = 0;
  if (sliced) {
    const int64_t begin = blockIdx.x * n_vec / gridDim.x, end = (blockIdx.x + 1) * n_vec / gridDim.x;
    data += begin;
    n_vec = end - begin;
  }
  const int64_t stride = sliced ? (int64_t)blockDim.x : (int64_t)gridDim.x * blockDim.x;
  const int64_t first = (sliced ? 0 : blockIdx.x * (int64_t)blockDim.x) + threadIdx.x;
  acc = read_with_work<kInFlight>(data, first, n_vec, stride, work, acc);
  if (acc == 0x9e3779b9u) *sink = acc; /* practically never taken; keeps the loads */
}

/* The experts kernel's way to stream: one CTA per SM, one producer lane issuing evict-first bulk
 * copies of `chunk` bytes into a ring of `stages`, consumer warps that only release each stage.
 * Deals: sliced, CTA c streams the chunks [c n / grid, (c + 1) n / grid); strided, chunk j goes to
 * CTA j % grid; claimed, the producer takes chunks from a counter, one claim ahead (launches that
 * wait only: each takes exactly chunks + grid tickets, so a launch's first ticket is a multiple of
 * that). Spins stand for a layer's work: start_cycles after the wait before the first copy (the
 * routing), pace_cycles per chunk in each consumer warp after it released the stage (the math). */
constexpr int kRingConsumerWarps = 4;
constexpr int kRingThreads = 32 * (1 + kRingConsumerWarps);
constexpr int kRingSmem = 200 * 1024;
constexpr int kRingMaxStages = 32;

enum class Deal { kSliced, kStrided, kClaimed };
const char *deal_name(Deal d) { return d == Deal::kSliced ? "sliced" : d == Deal::kStrided ? "strided" : "claimed"; }

/* One CTA's timeline in one launch (globaltimer ns), when asked for. */
struct RingStamps {
  unsigned long long waited, first_full, exit, spin_ns;
  long long spin_cycles;
  int chunks;
};

struct RingArgs {
  const uint8_t *data;
  int64_t chunks;
  int chunk, stages;
  uint32_t *sink;
  int wait_first;
  Deal deal;
  int start_cycles, pace_cycles;
  int first_wave;     /* copies issued before the first stage lands (the rest of the ring after it); 0: all */
  unsigned *tickets;  /* Deal::kClaimed */
  RingStamps *stamps; /* this launch's, one per CTA, or null */
  /* Chunks lie in experts: chunk c is chunk c % expert_chunks of expert experts[c / expert_chunks],
   * experts expert_chunks * chunk bytes apart from data (a layer's routed experts); null: contiguous. */
  const int *experts;
  int expert_chunks;
};

__device__ __forceinline__ const uint8_t *chunk_at(const RingArgs &a, int64_t c) {
  if (!a.experts) return a.data + c * a.chunk;
  const int64_t e = a.experts[c / a.expert_chunks];
  return a.data + (e * a.expert_chunks + c % a.expert_chunks) * a.chunk;
}

/* The claimed deal's next chunk of this launch, or -1 once they are all taken. */
__device__ __forceinline__ int64_t claim_chunk(const RingArgs &a) {
  const unsigned t = atomicAdd(a.tickets, 1u), per_launch = (unsigned)a.chunks + gridDim.x;
  const int64_t c = t % per_launch;
  return c < a.chunks ? c : -1;
}

__global__ void __launch_bounds__(kRingThreads, 1) chained_ring(const RingArgs a) {
  extern __shared__ __align__(128) uint8_t ring[];
  __shared__ uint64_t full[kRingMaxStages], empty[kRingMaxStages];
  __shared__ int64_t stage_chunk[kRingMaxStages]; /* the chunk a stage holds, -1: no more */
  if (threadIdx.x == 0) {
    for (int st = 0; st < a.stages; ++st) {
      kx::mbar_init(&full[st], 1);
      kx::mbar_init(&empty[st], kRingConsumerWarps);
    }
    kx::fence_barrier_init();
  }
  __syncthreads();
  kx::allow_dependents();
  const bool sliced = a.deal == Deal::kSliced;
  const int64_t first = sliced ? blockIdx.x * a.chunks / gridDim.x : blockIdx.x;
  const int64_t end = sliced ? (blockIdx.x + 1) * a.chunks / gridDim.x : a.chunks;
  const int64_t step = sliced ? 1 : gridDim.x;
  const int warp = threadIdx.x / 32;
  RingStamps *mine = a.stamps ? a.stamps + blockIdx.x : nullptr;
  if (warp == kRingConsumerWarps) {
    if (threadIdx.x % 32 == 0) {
      const uint64_t policy = kx::l2_evict_first_policy();
      if (a.wait_first) kx::wait_for_predecessor();
      if (mine) mine->waited = kx::global_ns();
      spin_cycles(a.start_cycles);
      const bool claimed = a.deal == Deal::kClaimed;
      int64_t c = claimed ? claim_chunk(a) : first;
      kx::RingPos at;
      for (int n = 0;; ++n, at.advance(a.stages)) {
        const bool done = claimed ? c < 0 : c >= end;
        if (n >= a.stages) kx::mbar_wait(&empty[at.stage], at.parity ^ 1u);
        if (n == a.first_wave && n > 0 && n < a.stages) kx::mbar_wait(&full[0], 0); /* the first stage landed */
        stage_chunk[at.stage] = done ? -1 : c;
        if (done) {
          kx::mbar_arrive(&full[at.stage]); /* no bytes: the consumers see -1 and stop */
          break;
        }
        kx::mbar_arrive_expect_tx(&full[at.stage], (uint32_t)a.chunk);
        kx::bulk_copy_streaming(ring + (size_t)at.stage * a.chunk, chunk_at(a, c), (uint32_t)a.chunk,
                                &full[at.stage], policy);
        c = claimed ? claim_chunk(a) : c + step;
      }
    }
  } else {
    kx::RingPos at;
    uint32_t acc = 0;
    int n = 0;
    unsigned long long first_full = 0, spin_ns = 0;
    long long spun = 0;
    for (;; ++n, at.advance(a.stages)) {
      kx::mbar_wait(&full[at.stage], at.parity);
      if (stage_chunk[at.stage] < 0) break;
      if (mine && n == 0) first_full = kx::global_ns();
      acc ^= ring[(size_t)at.stage * a.chunk + threadIdx.x];
      __syncwarp();
      if (threadIdx.x % 32 == 0) kx::mbar_arrive(&empty[at.stage]);
      const long long c0 = kx::clock_now();
      const unsigned long long t0 = mine ? kx::global_ns() : 0;
      spin_cycles(a.pace_cycles);
      if (mine) {
        spun += kx::clock_now() - c0;
        spin_ns += kx::global_ns() - t0;
      }
    }
    if (acc == 0x9e3779b9u) *a.sink = acc;
    if (mine && threadIdx.x == 0) {
      mine->first_full = first_full;
      mine->exit = kx::global_ns();
      mine->spin_ns = spin_ns;
      mine->spin_cycles = spun;
      mine->chunks = n;
    }
  }
}

struct Case {
  int ctas_per_sm, in_flight; /* ctas_per_sm 0: the bulk-copy ring, in_flight its stages */
  Follow follow;
  int rounds;
  Deal deal;                              /* the loads': sliced or strided; the ring's: any */
  int chunk;                              /* the ring's bytes a copy */
  int cluster, start_cycles, pace_cycles; /* the ring's cluster size and spins */
  int first_wave;                         /* the ring's (RingArgs) */
  int work;                               /* the loads': instructions a vector (work_on) */
};

struct Result {
  Case c;
  float us;
};

void launch_ring(const Case &c, int sms, const uint8_t *data, int64_t bytes, uint32_t *sink, unsigned *tickets,
                 RingStamps *stamps, cudaStream_t s, const int *experts = nullptr, int expert_chunks = 0) {
  const ChainedLaunch l(c.follow != Follow::kSerial, (unsigned)(sms / c.cluster * c.cluster), kRingThreads, kRingSmem,
                        c.cluster, s);
  const RingArgs a{data,   bytes / c.chunk, c.chunk,       c.in_flight,  sink,    c.follow == Follow::kWait ? 1 : 0,
                   c.deal, c.start_cycles,  c.pace_cycles, c.first_wave, tickets, stamps,
                   experts, expert_chunks};
  CHECK(cudaLaunchKernelEx(&l.cfg, chained_ring, a));
}

template <int kInFlight>
void launch(const Case &c, int sms, const uint4 *data, int64_t n_vec, uint32_t *sink, cudaStream_t s) {
  const ChainedLaunch l(c.follow != Follow::kSerial, (unsigned)(c.ctas_per_sm * sms), kThreads, 0, 1, s);
  CHECK(cudaLaunchKernelEx(&l.cfg, chained_read<kInFlight>, data, n_vec, sink, c.follow == Follow::kWait ? 1 : 0,
                           c.deal == Deal::kSliced ? 1 : 0, c.start_cycles, c.work));
}

std::string describe(const Case &c) {
  char t[96];
  if (c.ctas_per_sm == 0)
    snprintf(t, sizeof t, "bulk ring, %d stages of %d KB, %s%s", c.in_flight, c.chunk / 1024, deal_name(c.deal),
             c.cluster > 1 ? ", pairs" : "");
  else
    snprintf(t, sizeof t, "loads, %d CTAs/SM, %d in flight, %s", c.ctas_per_sm, c.in_flight, deal_name(c.deal));
  return t;
}

/* What every case runs on: the buffers (rotated), the loads' sink, the claimed deal's counter. */
struct Bench {
  int sms;
  std::vector<Dev *> bufs;
  uint32_t *sink;
  unsigned *tickets;
  cudaStream_t s;
};

/* Enqueues one graph's launches; stamps, if given: kBuffers x sms, round 0's launches. */
void enqueue(const Case &c, const Bench &b, int64_t bytes, RingStamps *stamps) {
  const int64_t n_vec = bytes / 16;
  for (int r = 0; r < c.rounds; ++r)
    for (int i = 0; i < kBuffers; ++i) {
      const uint4 *d = b.bufs[i]->as<const uint4>();
      RingStamps *st = stamps && r == 0 ? stamps + (size_t)i * b.sms : nullptr;
      if (c.ctas_per_sm == 0) launch_ring(c, b.sms, b.bufs[i]->as<const uint8_t>(), bytes, b.sink, b.tickets, st, b.s);
      else if (c.in_flight == 4) launch<4>(c, b.sms, d, n_vec, b.sink, b.s);
      else if (c.in_flight == 8) launch<8>(c, b.sms, d, n_vec, b.sink, b.s);
      else launch<16>(c, b.sms, d, n_vec, b.sink, b.s);
    }
}

float time_case(const Case &c, const Bench &b, int64_t bytes) {
  return graph_us(b.s, [&] { enqueue(c, b, bytes, nullptr); }) / (c.rounds * kBuffers);
}

/* One stamped replay of a ring case's graph: per launch after the first, from its earliest wait,
 * the medians over launches of: the median and last CTA's own wait (a CTA starts when the previous
 * launch frees its SM), the median and last CTA's first full stage after its own wait, the median
 * and last CTA's first full stage, the first, median and last CTA's exit, the wait and own first
 * stage of the CTA that exits last, and the gap from the previous launch's last exit to this one's
 * first wait; the SM clock from the consumers' spins; the most and fewest chunks a CTA took. */
void print_timeline(const Case &c, const Bench &b, int64_t bytes) {
  Dev stamps((size_t)kBuffers * b.sms * sizeof(RingStamps));
  const cudaGraphExec_t ge = capture_graph(b.s, [&] { enqueue(c, b, bytes, stamps.as<RingStamps>()); });
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(ge, b.s));
  CHECK(cudaStreamSynchronize(b.s));
  CHECK(cudaGraphExecDestroy(ge));
  std::vector<RingStamps> h((size_t)kBuffers * b.sms);
  CHECK(cudaMemcpy(h.data(), stamps.p, h.size() * sizeof(RingStamps), cudaMemcpyDeviceToHost));
  enum { kWaitMid, kWaitLast, kOwnMid, kOwnLast, kFullMid, kFullLast, kExitFirst, kExitMid, kExitLast, kEndWait,
         kEndOwn, kGap, kColumns };
  std::vector<double> col[kColumns], ghz;
  int most = 0, fewest = 1 << 30;
  for (int l = 1; l < kBuffers; ++l) {
    const RingStamps *now = &h[(size_t)l * b.sms], *before = &h[(size_t)(l - 1) * b.sms];
    unsigned long long t0 = ~0ull, prev_exit = 0;
    int last = 0;
    for (int i = 0; i < b.sms; ++i) {
      t0 = std::min(t0, now[i].waited);
      prev_exit = std::max(prev_exit, before[i].exit);
      if (now[i].exit > now[last].exit) last = i;
    }
    std::vector<double> wt, own, ff, ex;
    for (int i = 0; i < b.sms; ++i) {
      wt.push_back((now[i].waited - t0) / 1e3);
      own.push_back(((long long)now[i].first_full - (long long)now[i].waited) / 1e3);
      ff.push_back((now[i].first_full - t0) / 1e3);
      ex.push_back((now[i].exit - t0) / 1e3);
      if (c.pace_cycles > 0 && now[i].spin_ns > 0) ghz.push_back((double)now[i].spin_cycles / now[i].spin_ns);
      most = std::max(most, now[i].chunks);
      fewest = std::min(fewest, now[i].chunks);
    }
    const double row[kColumns] = {median(wt), percentile(wt, 1.0), median(own), percentile(own, 1.0), median(ff),
                                  percentile(ff, 1.0), percentile(ex, 0.0), median(ex), percentile(ex, 1.0),
                                  wt[last], own[last], ((long long)t0 - (long long)prev_exit) / 1e3};
    for (int k = 0; k < kColumns; ++k) col[k].push_back(row[k]);
  }
  double m[kColumns];
  for (int k = 0; k < kColumns; ++k) m[k] = median(col[k]);
  printf("    %-8s pace %4d: wait %4.2f / %4.2f  own first full %4.2f / %4.2f  first full %4.2f / %4.2f  exit %5.2f / "
         "%5.2f / %5.2f  last exit's wait %4.2f, own first full %4.2f  gap %4.2f us  clock %s  chunks %d-%d\n",
         deal_name(c.deal), c.pace_cycles, m[kWaitMid], m[kWaitLast], m[kOwnMid], m[kOwnLast], m[kFullMid],
         m[kFullLast], m[kExitFirst], m[kExitMid], m[kExitLast], m[kEndWait], m[kEndOwn], m[kGap],
         ghz.empty() ? "  -  " : (std::to_string(median(ghz)).substr(0, 4) + " GHz").c_str(), fewest, most);
}

}  // namespace

int main(int argc, char **argv) {
  const StreamProbe probe;
  const double floor_TBps = probe.floor_TBps;
  Bench b;
  b.sms = probe.sms;
  b.s = probe.s;

  struct Size {
    const char *name;
    int64_t bytes;
  };
  const Size sizes[] = {
      {"k3-tp8 B=1 (16 experts)", 16LL * 2193408},
      {"WsGemm N=4096 K=7168", 4096LL * 7168 * 2},
      {"k3-tp8 B=8 (~109 experts)", 109LL * 2193408},
  };
  int64_t largest = 0;
  for (const Size &z : sizes) largest = largest > z.bytes ? largest : z.bytes;
  for (int i = 0; i < kBuffers; ++i) {
    b.bufs.push_back(new Dev((size_t)largest));
    CHECK(cudaMemset(b.bufs.back()->p, 1 + i, (size_t)largest));
  }
  Dev sink(64), tickets(sizeof(unsigned));
  CHECK(cudaMemset(tickets.p, 0, sizeof(unsigned)));
  b.sink = sink.as<uint32_t>();
  b.tickets = tickets.as<unsigned>();
  const bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
  const bool loads_work = argc > 1 && strcmp(argv[1], "--loads-work") == 0;

  CHECK(cudaFuncSetAttribute(chained_ring, cudaFuncAttributeMaxDynamicSharedMemorySize, kRingSmem));
  printf("%d SMs; HBM read over 4 GiB: %.3f TB/s (the floor's bandwidth)\n", b.sms, floor_TBps);
  if (loads_work) {
    /* B = 1's bytes read by plain loads with a layer's start and math on them (no ring: each warp
     * goes at its own pace), beside the ring with the experts kernel's start and pace. */
    const int64_t bytes = sizes[0].bytes;
    const double floor_us = (double)bytes / (floor_TBps * 1e12) * 1e6;
    printf("\n%s after a wait, 8 launches a graph; us (x floor %.2f us)\n", sizes[0].name, floor_us);
    for (Deal deal : {Deal::kStrided, Deal::kSliced})
      for (int pace : {0, 720}) {
        const Case c{0, 4, Follow::kWait, 1, deal, 16384, 1, 2000, pace, 0};
        const float us = time_case(c, b, bytes);
        printf("    ring    %-7s 4 stages of 16 KB  start 2000 pace %3d          -> %7.2f %6.3f\n", deal_name(deal),
               pace, us, us / floor_us);
      }
    for (Deal deal : {Deal::kStrided, Deal::kSliced})
      for (int cps : {1, 2, 4})
        for (int inf : {4, 8})
          for (int start : {0, 2000})
            for (int work : {0, 32, 64, 128}) {
              const Case c{cps, inf, Follow::kWait, 1, deal, 0, 1, start, 0, 0, work};
              const float us = time_case(c, b, bytes);
              printf("    loads   %-7s %d CTAs/SM, %d in flight  start %4d work %3d  -> %7.2f %6.3f\n",
                     deal_name(deal), cps, inf, start, work, us, us / floor_us);
            }
    return 0;
  }
  for (const Size &z : sizes) {
    const double floor_us = (double)z.bytes / (floor_TBps * 1e12) * 1e6;
    std::vector<Result> results;
    for (Follow f : {Follow::kWait, Follow::kEarly, Follow::kSerial})
      for (int rounds : {1, 4}) {
        for (int cps : {1, 2, 4})
          for (int inf : {4, 8, 16})
            for (Deal deal : {Deal::kStrided, Deal::kSliced}) {
              if (quick && (inf == 16 || cps == 1)) continue;
              const Case c{cps, inf, f, rounds, deal, 0, 1, 0, 0, 0};
              results.push_back({c, time_case(c, b, z.bytes)});
            }
        for (int chunk : {8192, 16384, 32768})
          for (int stages : {4, 8})
            for (Deal deal : {Deal::kStrided, Deal::kSliced}) {
              if (chunk * stages > kRingSmem || (quick && chunk != 16384)) continue;
              const Case c{0, stages, f, rounds, deal, chunk, 1, 0, 0, 0};
              results.push_back({c, time_case(c, b, z.bytes)});
            }
      }
    printf("\n%s: %.1f MB, floor %.2f us\n", z.name, z.bytes / 1e6, floor_us);
    printf("  best per way and reader (launches a graph = 8 x rounds):\n");
    for (Follow f : {Follow::kWait, Follow::kEarly, Follow::kSerial})
      for (int rounds : {1, 4})
        for (bool ring : {false, true}) {
          const Result *best = nullptr;
          for (const Result &r : results)
            if (r.c.follow == f && r.c.rounds == rounds && (r.c.ctas_per_sm == 0) == ring &&
                (!best || r.us < best->us))
              best = &r;
          printf("    %-6s %2d a graph: %7.2f us  %.3fx the floor  %.2f TB/s  (%s)\n", follow_name(f), 8 * rounds,
                 best->us, best->us / floor_us, z.bytes / (best->us * 1e-6) / 1e12, describe(best->c).c_str());
        }
    printf("  every case: way, launches a graph: reader -> us (x floor)\n");
    for (const Result &r : results)
      printf("    %-6s %2d: %-48s -> %7.2f (%.3f)\n", follow_name(r.c.follow), 8 * r.c.rounds, describe(r.c).c_str(), r.us,
             r.us / floor_us);
  }

  /* The ring (16 KB copies) with a layer's start and pace, on B = 1's bytes: how much of the experts
   * kernel's time a spin standing for its routing (~2000 cycles after the wait) and for its MMA warps
   * (~720 cycles a 15 KB chunk) costs on a stream this fast, by deal and depth; and clusters of 2. */
  const int64_t b1 = sizes[0].bytes;
  const double b1_floor = (double)b1 / (floor_TBps * 1e12) * 1e6;
  printf("\n%s with spins: bulk ring after a wait, 8 launches a graph; us (x floor %.2f us)\n", sizes[0].name, b1_floor);
  printf("    %-7s %6s %5s %6s %6s -> %8s %8s\n", "deal", "stages", "pairs", "start", "pace", "us", "x floor");
  for (Deal deal : {Deal::kSliced, Deal::kStrided, Deal::kClaimed})
    for (int stages : {4, 8})
      for (int cluster : {1, 2})
        for (int start : {0, 2000})
          for (int pace : {0, 360, 720}) {
            if ((quick || deal == Deal::kClaimed) && (cluster == 2 || stages == 8)) continue;
            const Case c{0, stages, Follow::kWait, 1, deal, 16384, cluster, start, pace, 0};
            const float us = time_case(c, b, b1);
            printf("    %-7s %6d %5s %6d %6d -> %8.2f %8.3f\n", deal_name(deal), stages, cluster > 1 ? "yes" : "no",
                   start, pace, us, us / b1_floor);
          }
  /* A first wave smaller than the ring: 1 or 2 copies of 4 stages (a shorter queue ahead of every
   * CTA's first stage), or 4 copies of 6 or 8 stages (the first stage as early as with 4, and more
   * copies in flight later, while the consumers hold stages). */
  printf("    first wave (copies before the first stage lands) smaller than the ring:\n");
  printf("    %-7s %6s %5s %6s %6s -> %8s %8s\n", "deal", "stages", "wave", "start", "pace", "us", "x floor");
  for (Deal deal : {Deal::kSliced, Deal::kStrided})
    for (int stages : {4, 6, 8})
      for (int wave : {1, 2, 4})
        for (int pace : {0, 360, 720}) {
          if ((stages == 4) == (wave == 4)) continue;
          const Case c{0, stages, Follow::kWait, 1, deal, 16384, 1, 2000, pace, wave};
          const float us = time_case(c, b, b1);
          printf("    %-7s %6d %5d %6d %6d -> %8.2f %8.3f\n", deal_name(deal), stages, wave, 2000, pace, us,
                 us / b1_floor);
        }

  /* Where the time goes in those: one stamped replay each (the stamps' stores cost a little). */
  printf("\n%s, 4 stages of 16 KB, start 2000, one stamped replay; us from the launch's first wait, medians over its "
         "launches:\n    a CTA's wait, its first full stage after its own wait, its first full stage: median / last CTA; "
         "exit: first / median / last CTA;\n    the CTA that exits last: its wait and own first full stage; gap: the "
         "previous launch's last exit to this one's first wait\n", sizes[0].name);
  for (Deal deal : {Deal::kSliced, Deal::kStrided, Deal::kClaimed})
    for (int pace : {0, 720})
      print_timeline(Case{0, 4, Follow::kWait, 1, deal, 16384, 1, 2000, pace, 0}, b, b1);
  for (Dev *d : b.bufs) delete d;

  /* B = 1's bytes as a layer's 16 routed experts: k3-tp8 layers of 384 experts (2,193,408 bytes each,
   * 842 MB), 8 of them; experts 0-15 of each (contiguous) against 16 distinct random ones (spread
   * over the layer, as the experts kernel reads them), in the kernel's 17 KB chunks. */
  constexpr int kLayerExperts = 384, kRouted = 16, kChunk17 = 17408;
  constexpr int64_t kExpertBytes = 2193408;
  static_assert(kExpertBytes % kChunk17 == 0, "whole chunks per expert");
  std::vector<Dev *> layers;
  for (int l = 0; l < kBuffers; ++l) {
    layers.push_back(new Dev((size_t)(kLayerExperts * kExpertBytes)));
    CHECK(cudaMemset(layers.back()->p, 1 + l, (size_t)(kLayerExperts * kExpertBytes)));
  }
  Dev ids((size_t)2 * kBuffers * kRouted * sizeof(int)); /* [contiguous, random][layer][16] */
  std::vector<int> h_ids;
  uint64_t seed = 0x9e3779b97f4a7c15ull;
  for (int random = 0; random < 2; ++random)
    for (int l = 0; l < kBuffers; ++l) {
      std::vector<int> pick;
      while ((int)pick.size() < kRouted) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        const int e = random ? (int)((seed >> 33) % kLayerExperts) : (int)pick.size();
        if (std::find(pick.begin(), pick.end(), e) == pick.end()) pick.push_back(e);
      }
      h_ids.insert(h_ids.end(), pick.begin(), pick.end());
    }
  CHECK(cudaMemcpy(ids.p, h_ids.data(), h_ids.size() * sizeof(int), cudaMemcpyHostToDevice));
  const int64_t routed = kRouted * kExpertBytes;
  const double routed_floor = (double)routed / (floor_TBps * 1e12) * 1e6;
  printf("\n%s as 16 experts of 8 layers of 384 (842 MB each), bulk ring of 4 stages of 17 KB after a wait, 8 launches a "
         "graph; us (x floor %.2f us)\n", sizes[0].name, routed_floor);
  printf("    %-10s %-7s %6s %6s -> %8s %8s\n", "experts", "deal", "start", "pace", "us", "x floor");
  for (int random = 0; random < 2; ++random)
    for (Deal deal : {Deal::kSliced, Deal::kStrided})
      for (int spins = 0; spins < 2; ++spins) {
        const Case c{0, 4, Follow::kWait, 1, deal, kChunk17, 1, spins ? 2000 : 0, spins ? 720 : 0, 0};
        const float us = graph_us(b.s, [&] {
          for (int l = 0; l < kBuffers; ++l)
            launch_ring(c, b.sms, layers[l]->as<const uint8_t>(), routed, b.sink, b.tickets, nullptr, b.s,
                        ids.as<const int>() + (random * kBuffers + l) * kRouted, (int)(kExpertBytes / kChunk17));
        }) / kBuffers;
        printf("    %-10s %-7s %6d %6d -> %8.2f %8.3f\n", random ? "random" : "contiguous", deal_name(deal),
               c.start_cycles, c.pace_cycles, us, us / routed_floor);
      }
  for (Dev *d : layers) delete d;
  return 0;
}
