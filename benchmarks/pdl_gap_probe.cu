/* pdl_gap_probe.cu: how long a dependent launch's griddepcontrol.wait returns after its
 * predecessor's last CTA exits, on a chain of one-CTA-per-SM launches in a CUDA graph. A
 * stand-alone study (not part of the library build):
 *
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels -Ibenchmarks \
 *        benchmarks/pdl_gap_probe.cu -o /tmp/pdl_gap_probe && /tmp/pdl_gap_probe
 *
 * Why: the experts kernel's marks at B = 1 put 13.5 us from the first CTA past the wait to the
 * last exit, in a layer of 14.9 us: ~1.4 us a layer go between one launch's last exit and the
 * next one's wait. Whether that is the launch boundary itself or something this kernel leaves
 * behind (stores in flight, late CTAs) decides whether it is worth chasing.
 *
 * Each launch: one CTA per SM (dynamic shared memory sized so, unused), launch_dependents at
 * entry, then the predecessor wait, then a spin of `spin_ns` (CTAs below `heavy` spin `extra_ns`
 * more, as the experts kernel's busiest CTAs do), then `stores` 16-byte stores per thread, then
 * the exit stamp. Prints per case the medians over the chain's boundaries of: wait - the
 * predecessor's last exit (first CTA, median CTA, last CTA), how many CTAs entered after that
 * exit, and the cycles of each CTA's first two loads after the wait (lines the predecessor
 * wrote; median CTA): the experts kernel's router has its ids ~1.6 kcycles after the wait.
 *
 * Session 33 (results/experts-session33-h200.log): the wait returns 0.35-0.42 us after the last
 * exit (0.45-0.74 with 64 KB stored a CTA just before it; 0.61-0.74 without PDL), and the loads
 * take 0.40 / 0.45 kcycles: the launch boundary is not where the experts layer loses time.
 */
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

#include "harness.cuh"
#include "pipeline.cuh"

namespace {

constexpr int kThreads = 128;
constexpr int kLayers = 8;
constexpr int kSmemBytes = 160 * 1024; /* two do not fit on one SM */

struct Stamps {
  unsigned long long entry, waited, exit;
  long long load_cycles[2]; /* the first two global loads after the wait (lines the predecessor wrote) */
};

using kx::clock_now;

__global__ void __launch_bounds__(kThreads, 1)
    chained(Stamps *stamps, uint4 *sink, unsigned *lines, long long spin_ns, long long extra_ns, int heavy,
            int stores) {
  const unsigned long long entry = kx::global_ns();
  kx::allow_dependents();
  kx::wait_for_predecessor();
  const unsigned long long waited = kx::global_ns();
  __shared__ unsigned seen[2];
  const long long t0 = clock_now();
  const unsigned line = __ldcg(&lines[blockIdx.x * 32]); /* its predecessor CTA's */
  *(volatile unsigned *)seen = line; /* issues only once the load is back: the stamp after it is too */
  const long long t1 = clock_now();
  const unsigned next = __ldcg(&lines[(blockIdx.x + 1) % gridDim.x * 32]); /* another CTA's */
  ((volatile unsigned *)seen)[1] = next;
  const long long load_cycles[2] = {t1 - t0, clock_now() - t1};
  const long long spin = spin_ns + ((int)blockIdx.x < heavy ? extra_ns : 0);
  while ((long long)(kx::global_ns() - waited) < spin) {
  }
  uint4 *mine = sink + ((size_t)blockIdx.x * stores) * kThreads + threadIdx.x;
  for (int i = 0; i < stores; ++i) mine[i * kThreads] = make_uint4(i, blockIdx.x, threadIdx.x, 0);
  if (threadIdx.x == 0) lines[blockIdx.x * 32] = *(volatile unsigned *)seen + 1;
  __syncthreads();
  if (threadIdx.x == 0) stamps[blockIdx.x] = Stamps{entry, waited, kx::global_ns(), {load_cycles[0], load_cycles[1]}};
}

struct Case {
  const char *name;
  bool pdl;
  long long spin_ns, extra_ns;
  int heavy, stores;
};

void run_case(const Case &k, int sms, cudaStream_t stream) {
  Dev stamps((size_t)kLayers * sms * sizeof(Stamps)), sink((size_t)sms * kThreads * 64 * sizeof(uint4)),
      lines((size_t)sms * 32 * sizeof(unsigned));
  CHECK(cudaMemset(lines.p, 0, (size_t)sms * 32 * sizeof(unsigned)));
  const auto body = [&] {
    for (int l = 0; l < kLayers; ++l) {
      const ChainedLaunch launch(k.pdl, sms, kThreads, kSmemBytes, 1, stream);
      CHECK(cudaLaunchKernelEx(&launch.cfg, chained, stamps.as<Stamps>() + (size_t)l * sms, sink.as<uint4>(),
                               lines.as<unsigned>(), k.spin_ns, k.extra_ns, k.heavy, k.stores));
    }
  };
  const float us = graph_us(stream, body) / kLayers;
  const cudaGraphExec_t ge = capture_graph(stream, body);
  CHECK(cudaGraphLaunch(ge, stream));
  CHECK(cudaStreamSynchronize(stream));
  CHECK(cudaGraphExecDestroy(ge));
  std::vector<Stamps> h((size_t)kLayers * sms);
  CHECK(cudaMemcpy(h.data(), stamps.p, h.size() * sizeof(Stamps), cudaMemcpyDeviceToHost));
  std::vector<double> first, mid, last, late, load, load2;
  for (int l = 1; l < kLayers; ++l) {
    unsigned long long prev_exit = 0;
    for (int c = 0; c < sms; ++c) prev_exit = std::max(prev_exit, h[(size_t)(l - 1) * sms + c].exit);
    std::vector<double> w, ld, ld2;
    int entered_late = 0;
    for (int c = 0; c < sms; ++c) {
      const Stamps &s = h[(size_t)l * sms + c];
      w.push_back((double)(long long)(s.waited - prev_exit) / 1000.0);
      entered_late += s.entry > prev_exit;
      ld.push_back(s.load_cycles[0] / 1000.0);
      ld2.push_back(s.load_cycles[1] / 1000.0);
    }
    load.push_back(median(ld));
    load2.push_back(median(ld2));
    first.push_back(percentile(w, 0.0));
    mid.push_back(median(w));
    last.push_back(percentile(w, 1.0));
    late.push_back(entered_late);
  }
  printf("%-34s %7.2f us a launch | wait after the last exit: first %5.2f median %5.2f last %5.2f us | "
         "CTAs entered after it: %3.0f | loads after the wait %.2f, %.2f kcycles\n",
         k.name, us, median(first), median(mid), median(last), median(late), median(load), median(load2));
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaFuncSetAttribute(chained, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  printf("%d SMs, %d launches a graph; medians over the chain's %d boundaries\n", sms, kLayers, kLayers - 1);
  const Case cases[] = {
      {"pdl, even 10 us", true, 10000, 0, 0, 0},
      {"pdl, 20 CTAs 3 us longer", true, 10000, 3000, 20, 0},
      {"pdl, even, 64 KB stored a CTA", true, 10000, 0, 0, 32},
      {"pdl, 20 longer, 64 KB stored", true, 10000, 3000, 20, 32},
      {"no pdl, even 10 us", false, 10000, 0, 0, 0},
      {"no pdl, 20 CTAs 3 us longer", false, 10000, 3000, 20, 0},
  };
  for (const Case &k : cases) run_case(k, sms, stream);
  return 0;
}
