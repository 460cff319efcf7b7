/* probe_work.cuh: what the stream probes (small_read_probe.cu, one_token_probe.cu, gemv_probe.cu) put on
 * a stream to stand for a layer's own work: a spin of so many SM cycles, integer math on each loaded
 * vector, and the strided read that does that math on what it loads; and random weight bytes for the
 * harnesses that stream them. Device code only. */
#pragma once

#include <stdint.h>

#include "pipeline.cuh"

__device__ __forceinline__ void spin_cycles(int cycles) {
  const long long t0 = kx::clock_now();
  while (kx::clock_now() - t0 < cycles) {
  }
}

/* ~`work` integer instructions on a loaded vector in two dependent chains (IMAD, SHF, LOP3; ~9
 * issued for each 8 of `work`), standing for a layer's math on 16 bytes of its weights: the experts
 * kernel's one-token MMA warps issue ~30 a 16-byte vector (~61 a warp for each of a 17 KB chunk's
 * 34 warp-vectors, session 43). */
__device__ __forceinline__ uint32_t work_on(uint32_t acc, uint4 v, int work) {
  uint32_t a = acc ^ v.x, b = v.y, c = v.z, d = v.w;
#pragma unroll 1
  for (int k = 0; k < work; k += 8) {
    a = a * 0x9E3779B1u + b;
    b = __funnelshift_l(b, c, 5) ^ a;
    c = c * 0x85EBCA77u + d;
    d = __funnelshift_l(d, a, 7) ^ c;
  }
  return a ^ b ^ c ^ d;
}

/* Vectors i, i + stride, .. below end of w, streaming (evict-first) loads `kInFlight` ahead of the
 * math on them; the last few one at a time. */
template <int kInFlight>
__device__ __forceinline__ uint32_t read_with_work(const uint4 *w, int64_t i, int64_t end, int64_t stride, int work,
                                                   uint32_t acc) {
  for (; i + (kInFlight - 1) * stride < end; i += kInFlight * stride) {
    uint4 v[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) v[j] = __ldcs(w + i + j * stride);
#pragma unroll
    for (int j = 0; j < kInFlight; ++j) acc = work_on(acc, v[j], work);
  }
  for (; i < end; i += stride) acc = work_on(acc, __ldcs(w + i), work);
  return acc;
}

/* Random FP4 bytes; scale bytes in [124, 130], so the weights stay finite. */
__global__ void fill_weights(uint8_t *bytes, size_t n, uint32_t seed, int scales) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    bytes[i] = scales ? (uint8_t)(124 + h % 7) : (uint8_t)h;
  }
}
