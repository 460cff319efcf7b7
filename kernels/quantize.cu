/* quantize.cu: bf16 -> MXFP8 on the device (SPEC 2), the plan step on its own.
 *
 * The experts kernel quantizes x inside its own launch (quantize_store_x, bit for bit
 * quantize_block32's rceil); this entry point exposes quantize_block32 to kx.quantize_mxfp8
 * for CUDA tensors, so tests hold the device result bit for bit against the CPU backend and
 * the reference. One thread per block of 32 values: 64 bytes in, 32 + 1 bytes out.
 */
#include <cuda_bf16.h>

#include "kimi_kernels.h"
#include "mx.cuh"

namespace kx {
namespace {

constexpr int kQuantizeThreads = 256;

__global__ void quantize_mxfp8_kernel(kx_quantize_args a) {
  const int64_t blocks_per_row = a.cols / kMxBlock;
  const int64_t b = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (b >= a.rows * blocks_per_row) return;
  const int64_t r = b / blocks_per_row, kb = b % blocks_per_row;
  const __nv_bfloat16 *src = (const __nv_bfloat16 *)a.x + r * a.x_row_stride + kb * kMxBlock;
  float v[kMxBlock];
#pragma unroll
  for (int i = 0; i < kMxBlock; ++i) v[i] = __bfloat162float(src[i]);
  uint32_t q[kMxBlock / 4];
  a.scales[b] = quantize_block32(v, a.floor_mode != 0, q);
  uint8_t *dst = a.q + r * a.cols + kb * kMxBlock;
  if (((uintptr_t)a.q & 3) == 0) { /* every block alike: cols % 32 == 0 */
#pragma unroll
    for (int i = 0; i < kMxBlock / 4; ++i) ((uint32_t *)dst)[i] = q[i];
  } else { /* a caller's uint8 view that starts off a word */
#pragma unroll
    for (int i = 0; i < kMxBlock; ++i) dst[i] = (uint8_t)(q[i / 4] >> (8 * (i % 4)));
  }
}

}  // namespace
}  // namespace kx

extern "C" cudaError_t kx_quantize_mxfp8(const kx_quantize_args *args, cudaStream_t stream) {
  if (args->cols % kx::kMxBlock != 0) return cudaErrorInvalidValue;
  const int64_t blocks = args->rows * (args->cols / kx::kMxBlock);
  if (blocks == 0) return cudaSuccess;
  const int64_t grid = (blocks + kx::kQuantizeThreads - 1) / kx::kQuantizeThreads;
  kx::quantize_mxfp8_kernel<<<(unsigned)grid, kx::kQuantizeThreads, 0, stream>>>(*args);
  return cudaGetLastError();
}
