/* probe.cu: two tiny kernels that are not part of the MoE math.
 *
 * kx_probe_add proves the build wiring: csrc/ calls through kimi_kernels.h into a
 * kernel compiled by nvcc and linked into the same extension.
 * kx_probe_read is the benchmarks' yardstick: a plain vectorized read of n bytes (each
 * byte once, 16-byte loads, a grid-stride loop) whose time gives the HBM read bandwidth
 * that every floor in benchmarks/ is quoted against. Folding the words into a sink keeps
 * the compiler from dropping the loads.
 */
#include "kimi_kernels.h"

namespace {

constexpr int kProbeThreads = 512;

__global__ void probe_add_kernel(const float *in, float *out, float value, int64_t n) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    out[i] = in[i] + value;
}

__global__ void probe_read_kernel(const uint4 *data, int64_t n_vec, uint32_t *sink) {
  uint32_t acc = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  /* four independent loads in flight per thread before the first use */
  for (; i + 3 * stride < n_vec; i += 4 * stride) {
    uint4 a = __ldcs(data + i), b = __ldcs(data + i + stride);
    uint4 c = __ldcs(data + i + 2 * stride), d = __ldcs(data + i + 3 * stride);
    acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
    acc ^= c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
  }
  for (; i < n_vec; i += stride) {
    uint4 a = __ldcs(data + i);
    acc ^= a.x ^ a.y ^ a.z ^ a.w;
  }
  if (acc == 0x9e3779b9u) *sink = acc; /* practically never taken; keeps the loads */
}

int grid_for(int64_t work) {
  int device = 0, sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess)
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  int64_t blocks = (work + kProbeThreads - 1) / kProbeThreads;
  int64_t cap = (int64_t)sms * 4;
  return (int)(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

}  // namespace

extern "C" cudaError_t kx_probe_add(const float *in, float *out, float value, int64_t n,
                                    cudaStream_t stream) {
  probe_add_kernel<<<grid_for(n), kProbeThreads, 0, stream>>>(in, out, value, n);
  return cudaGetLastError();
}

extern "C" cudaError_t kx_probe_read(const void *data, int64_t n_bytes, uint32_t *sink,
                                     cudaStream_t stream) {
  if (((uintptr_t)data & 15) != 0 || (n_bytes & 15) != 0) return cudaErrorInvalidValue;
  int64_t n_vec = n_bytes / 16;
  probe_read_kernel<<<grid_for(n_vec), kProbeThreads, 0, stream>>>((const uint4 *)data, n_vec,
                                                                  sink);
  return cudaGetLastError();
}
