/* pack.cu: standard-layout MXFP4 expert weights -> the kernel layout (moe_layout.cuh).
 *
 * Runs once when a PersistentExperts is built; speed hardly matters, so one thread
 * writes one lane's 8 fragment bytes of one unit (and, for lanes 0..7, its two scale
 * bytes). Reads the caller's tensors only.
 */
#include "kimi_kernels.h"
#include "moe_layout.cuh"

namespace kx {
namespace {

constexpr int kPackThreads = 256;

struct PackSource {
  const uint8_t *w;   /* [E, rows, K/2] */
  const uint8_t *s;   /* [E, rows, K/32] */
  int rows, k;
};

__device__ uint32_t nibble(const uint8_t *row, int k) {
  uint8_t b = row[k >> 1];
  return (k & 1) ? (b >> 4) : (b & 0xF);
}

/* fc1: gate/up strip pairs (fc1_row); fc2: 4, 8 or 16 consecutive strips. */
__global__ void pack_phase_kernel(PackSource src, PhaseShape phase, int experts, int inter,
                                  bool is_fc1, uint8_t *packed) {
  const int64_t units = (int64_t)experts * phase.tiles * phase.strips * phase.k_blocks;
  const int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
  if (i >= units * 32) return;
  const int lane = (int)(i % 32);
  int64_t u = i / 32;
  const int kb = (int)(u % phase.k_blocks); u /= phase.k_blocks;
  const int s = (int)(u % phase.strips); u /= phase.strips;
  const int f = (int)(u % phase.tiles);
  const int e = (int)(u / phase.tiles);

  const int row0 = is_fc1 ? fc1_row(inter, f, s) : fc2_row(phase.strips, f, s);
  const int g = lane >> 2, t = lane & 3;
  const uint8_t *w_e = src.w + (int64_t)e * src.rows * (src.k / 2);
  const uint8_t *row_g = w_e + (int64_t)(row0 + g) * (src.k / 2);
  const uint8_t *row_g8 = w_e + (int64_t)(row0 + g + 8) * (src.k / 2);

  const int c = kb / phase.chunk_kb, kb_in_chunk = kb % phase.chunk_kb;
  const int nkb = phase.chunk_k_blocks(c);
  uint8_t *chunk = packed + phase.chunk_offset(e, f, c);
  const int unit = s * nkb + kb_in_chunk;

  /* Word w feeds the four f16x2 registers of MMA w (k 16w..16w+15): register i is row
   * g (i even) or g+8 (i odd) at k = 16w + 2t + 8(i/2) (+1 in its high half); its bits go
   * where decode_fp4x8 finds them (nibble_word_bit).
   * A NaN block (scale 0xFF) keeps its scale and gets zero elements: the kernel reads the
   * scale as inf and 0 * inf is NaN (e8m0_to_float_nonzero). */
  const uint8_t *s_e = src.s + (int64_t)e * src.rows * (src.k / 32);
  const bool nan_g = s_e[(int64_t)(row0 + g) * (src.k / 32) + kb] == 0xFF;
  const bool nan_g8 = s_e[(int64_t)(row0 + g + 8) * (src.k / 32) + kb] == 0xFF;
  uint8_t out[8];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const bool upper = i & 1;
      const uint8_t *row = upper ? row_g8 : row_g;
      const bool nan = upper ? nan_g8 : nan_g;
      const int k = kb * 32 + 16 * w + 2 * t + 8 * (i / 2);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t n = nan ? 0u : nibble(row, k + half);
        word |= (n >> 3) << nibble_word_bit(i, 15 + 16 * half);
#pragma unroll
        for (int b = 0; b < 3; ++b) word |= ((n >> b) & 1u) << nibble_word_bit(i, 9 + b + 16 * half);
      }
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) out[4 * w + b] = (uint8_t)(word >> (8 * b));
  }
  uint8_t *dst = chunk + (int64_t)unit * kUnitWeightBytes + lane * 8;
#pragma unroll
  for (int b = 0; b < 8; ++b) dst[b] = out[b];

  if (lane < 8) {
    uint8_t *scales = chunk + (int64_t)phase.strips * nkb * kUnitWeightBytes + unit * kUnitScaleBytes;
    scales[2 * lane] = s_e[(int64_t)(row0 + lane) * (src.k / 32) + kb];
    scales[2 * lane + 1] = s_e[(int64_t)(row0 + lane + 8) * (src.k / 32) + kb];
  }
}

cudaError_t pack_phase(PackSource src, PhaseShape phase, int experts, int inter, bool is_fc1,
                       uint8_t *packed, cudaStream_t stream) {
  const int64_t threads = (int64_t)experts * phase.tiles * phase.strips * phase.k_blocks * 32;
  const int64_t blocks = (threads + kPackThreads - 1) / kPackThreads;
  pack_phase_kernel<<<(unsigned)blocks, kPackThreads, 0, stream>>>(src, phase, experts, inter,
                                                                   is_fc1, packed);
  return cudaGetLastError();
}

}  // namespace
}  // namespace kx

extern "C" size_t kx_moe_packed_bytes(const kx_moe_shape *shape) {
  kx::PhaseShape fc2 = kx::fc2_shape(shape->experts, shape->hidden, shape->inter);
  return (size_t)(fc2.base + (int64_t)shape->experts * fc2.expert_bytes);
}

extern "C" cudaError_t kx_moe_pack(const kx_moe_pack_args *args, cudaStream_t stream) {
  const kx_moe_shape &sh = args->shape;
  uint8_t *packed = (uint8_t *)args->packed;
  kx::PackSource fc1_src{args->w13, args->s13, 2 * sh.inter, sh.hidden};
  kx::PackSource fc2_src{args->w2, args->s2, sh.hidden, sh.inter};
  cudaError_t err = kx::pack_phase(fc1_src, kx::fc1_shape(sh.experts, sh.hidden, sh.inter),
                                   sh.experts, sh.inter, true, packed, stream);
  if (err != cudaSuccess) return err;
  return kx::pack_phase(fc2_src, kx::fc2_shape(sh.experts, sh.hidden, sh.inter), sh.experts,
                        sh.inter, false, packed, stream);
}
