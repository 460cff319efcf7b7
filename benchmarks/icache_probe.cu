/* icache_probe.cu: how much straight-line code an SM keeps warm, and whether a launch finds the
 * code its predecessor ran still cached. A stand-alone study (not part of the library build):
 *
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels benchmarks/icache_probe.cu \
 *        -o /tmp/icache_probe && /tmp/icache_probe
 *
 * Why: session 32's ncu of the one-token experts kernel found ~14 % of its warp stalls on
 * instruction fetch, at code that runs once per tile or per phase (~0.5-1 kcycle a run), and
 * two warm-ups that ran such code early lost. Whether the misses come from a cache too small for
 * the kernel's working set or from every launch starting cold decides what can help.
 *
 * One CTA per SM, four warps (one per scheduler); each runs a block of kInstr integer adds (16
 * bytes of code each) three times in a row and stamps clock64() around each pass. Pass 0
 * fetches the block, passes 1 and 2 find it cached if it fits. Each size runs twice, as two launches
 * back to back on one stream: if the second launch's pass 0 is as fast as pass 1, the code survived
 * the launch boundary. Prints, per size, the median over the SMs of cycles per instruction.
 *
 * Session 33 (results/experts-session33-h200.log): 8-64 KB run at 2.0-2.1 cycles per instruction
 * on their first pass, 128 KB at 4.1 on its first and 2.0 after, 256 KB at 5.1 always; a second
 * launch runs its first pass at 2.0 up to 128 KB. An SM keeps ~128 KB of code across launches.
 */
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <vector>

#include "harness.cuh"

namespace {

constexpr int kPasses = 3;
constexpr int kWarps = 4;

/* eight adds of registers into each other (ptxas folds adds of constants into one): every one
 * stays an instruction */
#define KX_ADDS8                                                                                   \
  asm volatile("add.u32 %0, %0, %1; add.u32 %1, %1, %2; add.u32 %2, %2, %3; add.u32 %3, %3, %0;\n\t" \
               "add.u32 %0, %0, %2; add.u32 %1, %1, %3; add.u32 %2, %2, %0; add.u32 %3, %3, %1;"   \
               : "+r"(a), "+r"(b), "+r"(c), "+r"(d))

template <int kInstr>
__global__ void __launch_bounds__(kWarps * 32, 1) straight_code(unsigned long long *cycles, uint32_t *sink) {
  uint32_t a = threadIdx.x, b = a + 1, c = a + 2, d = a + 3;
  for (int pass = 0; pass < kPasses; ++pass) { /* not unrolled: one copy of the block */
    __syncwarp();
    const long long t0 = clock64();
#pragma unroll
    for (int i = 0; i < kInstr / 8; ++i) KX_ADDS8;
    __syncwarp();
    const long long t1 = clock64();
    if (threadIdx.x == 0) cycles[blockIdx.x * kPasses + pass] = (unsigned long long)(t1 - t0);
  }
  if ((a ^ b ^ c ^ d) == 0x9E3779B9u) *sink = a; /* keeps the adds */
}

template <int kInstr>
void run_size(int sms, unsigned long long *d_cycles, uint32_t *d_sink, cudaStream_t stream) {
  std::vector<unsigned long long> host[2];
  for (int launch = 0; launch < 2; ++launch) {
    straight_code<kInstr><<<sms, kWarps * 32, 0, stream>>>(d_cycles + (size_t)launch * sms * kPasses, d_sink);
    CHECK(cudaGetLastError());
  }
  CHECK(cudaStreamSynchronize(stream));
  printf("%6d instr (~%3d KB):", kInstr, kInstr * 16 / 1024);
  for (int launch = 0; launch < 2; ++launch) {
    host[launch].resize((size_t)sms * kPasses);
    CHECK(cudaMemcpy(host[launch].data(), d_cycles + (size_t)launch * sms * kPasses,
                     host[launch].size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
    printf("  launch %d:", launch);
    for (int pass = 0; pass < kPasses; ++pass) {
      std::vector<double> per;
      for (int s = 0; s < sms; ++s) per.push_back((double)host[launch][(size_t)s * kPasses + pass] / kInstr);
      printf(" %6.2f", median(per));
    }
  }
  printf("\n");
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  Dev cycles((size_t)2 * sms * kPasses * sizeof(unsigned long long)), sink(4);
  printf("cycles per instruction of warp 0, median over %d SMs, passes 0 / 1 / 2 of two back-to-back launches\n", sms);
  run_size<512>(sms, cycles.as<unsigned long long>(), sink.as<uint32_t>(), stream);
  run_size<1024>(sms, cycles.as<unsigned long long>(), sink.as<uint32_t>(), stream);
  run_size<2048>(sms, cycles.as<unsigned long long>(), sink.as<uint32_t>(), stream);
  run_size<4096>(sms, cycles.as<unsigned long long>(), sink.as<uint32_t>(), stream);
  run_size<8192>(sms, cycles.as<unsigned long long>(), sink.as<uint32_t>(), stream);
  run_size<16384>(sms, cycles.as<unsigned long long>(), sink.as<uint32_t>(), stream);
  return 0;
}
