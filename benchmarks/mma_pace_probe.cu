/* mma_pace_probe.cu: the experts kernel's MMA warps' cycles per chunk with the chunk's data
 * already in shared memory (no copies, no producer, no waits unless a variant adds them), or fed
 * through the kernel's kind of ring. Not part of the library build; a study tool (session 43).
 *
 * One CTA per SM as in the kernel (24 warps, 16 of them MMA warps, the others idle unless a
 * variant makes two of them producers), 4 stages of random FP4 words and E8M0 scales and 8 rows of
 * x; each MMA warp runs an FC1 chunk (4 strips x 16 k-blocks, 4 units a warp) 2000 times over the
 * 4 stages and reports clock64 cycles per chunk and the SM clock (cycles over globaltimer), the
 * medians over every warp of 5 launches. The one-token loop unless "wide". Variants:
 *   main            consume_units as the kernel runs it (loads, decode + MMA, release; in
 *                   sessions 43-44's readings in NOTES.md the release still came before the math)
 *   main + waits    the same after an mbar_wait per chunk on a barrier whose phase is complete
 *   decode = mask   each FP4 word masked once instead of decoded (timing only: wrong values)
 *   no decode/MMA   the loads and FFMAs kept, decode and MMAs replaced by two XORs (timing only)
 *   8 MMA warps     8 warps of 8 units each (kStep 2) instead of 16 of 4
 *   k-major         warp w takes k-block w of all 4 strips: one x fragment a chunk, not four
 *   copies from L2  main fed through the ring as the kernel feeds it: the weight warp's bulk copies
 *                   (17 KB a stage, full / empty barriers) from 8 chunks every CTA shares (L2-resident)
 *   copies from HBM the same from 64 chunks of each CTA's own (147 MB in all: the HBM stream's pace)
 *   wide from HBM   the loop of launches of several tokens fed the same way: every MMA column summed and x's
 *                   8 token rows copied into each stage by an activation warp (a 1 KB copy a row, as
 *                   copy_activations does) from L2-resident rows
 *   wide from L2    the same with the weights from L2 too (the wide loop's own pace, fed as in the kernel)
 *   wide, 1 scale load  wide from L2 with a warp's 4 scale pairs as one 8-byte load a lane, as if the packer
 *                   kept them together (timing only: the scales read are other bytes)
 *   wide, k-major   wide from L2, warp w taking k-block w of all 4 strips (one x fragment a chunk)
 *   wide, no x copy wide from L2 with the stages' x rows left as they are (no activation warp)
 *   wide, 2 columns wide from L2 summing MMA columns 0 and 2 only, as a one-token launch does
 *   wgmma           main's units through wgmma (session 52): each warpgroup (4 strips of one k-slot) issues
 *                   a unit's two MMAs as two m64n8k16 with A its warps' decoded fragments from registers and
 *                   B x's 8 rows from shared memory (one commit and wait a chunk); its sums are checked
 *                   against main's
 *   wgmma from HBM  the same fed through the ring as "copies from HBM"
 *   stream only     the ring of "copies from HBM" with MMA warps that only wait for each stage and release it
 *   stream, 1 warp  the same with one MMA warp waiting and releasing, the other 15 gone
 *   wide k-maj HBM  wide from HBM, k-major
 *   wide 3 rows HBM wide from HBM with 3 x rows copied into each stage (B = 64's ~2.7 tokens a unit), not 8
 *   wide 16 tok HBM wide from HBM with units of 16 tokens: each decoded weight fragment meets two MMA column
 *                   tiles, the stage's 8 x rows and 8 more from resident x (what a hot expert's 16-token unit
 *                   would cost the MMA warps; its second 8 rows' copies not counted)
 *   wgmma e4m3      a unit as one m64n8k32 e4m3 wgmma (session 55): A the warps' FP4 words placed as e4m3
 *                   in registers (value x 2^-6, two LOP3 and two shifts a register pair more than a mask),
 *                   B 8 rows of e4m3 x from shared memory, each sum scaled by its row's weight scale times
 *                   its column's x scale (x's scales cannot be folded into e4m3 codes as they are into
 *                   f16 ones). Whether the FP8 tensor path costs less energy a chunk than f16's, which
 *                   the power cap turns into rate at B >= 8. Timing and energy only: the codes are random
 *                   and the sums are checked for being finite, not against a reference
 *   wgmma e4m3 HBM  the same fed through the ring as "copies from HBM"
 *   no math HBM     "no decode/MMA" fed through the ring as "copies from HBM": whether less work a chunk
 *                   lifts the clock the power cap leaves, and the rate with it
 *   copies HBM 6 st, wide 3 rows 6 st  "copies from HBM" and "wide 3 rows HBM" with a ring of 6 stages
 *                   instead of 4: whether the rate at the cap is the bytes in flight (Little's law) or a
 *                   path that runs at the capped clock
 *   copies HBM 3 st, wide 3 rows 3 st  the same with 3 stages
 * each with x's fragments from 8 token rows (launches of several tokens) or all lanes reading
 * row 0 (a one-token launch's broadcast; wgmma reads 8 rows in both).
 * With --sustain S, a second table: each of a few variants (--only: those of these indices in Variant)
 * launched back to back for S seconds, then S seconds more timed against the board's energy counter
 * (NVML, dlopen'ed), three passes: its power, energy a chunk and chunks a us, what the power cap
 * makes of them.
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels \
 *        benchmarks/mma_pace_probe.cu kernels/pack.cu kernels/quantize.cu kernels/probe.cu -o /tmp/pace -ldl
 *   /tmp/pace [--sustain 1.0 [--only 16,17]] [--constant]   (--constant: the copies' source all 0x35)
 */
#include "../kernels/experts.cu"

#include <dlfcn.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <utility>
#include <vector>

#include "harness.cuh"

namespace kx {
namespace {

enum Variant {
  kMain, kMainWait, kOneMask, kNoMma, kHalfWarps, kKMajor, kCopiesL2, kCopiesHbm,
  kWideHbm, kWideL2, kWideScales, kWideKMajor, kWideNoX, kWideTwoCols, kWgmma, kWgmmaHbm, kStreamOnly, kStreamOneWarp,
  kWideKMajorHbm, kWide3Hbm, kWide16Hbm, kWgmma8, kWgmma8Hbm, kNoMmaHbm, kCopiesHbm6, kWide3Hbm6, kCopiesHbm3, kWide3Hbm3, kVariants
};
const char *const kVariantNames[kVariants] = {
    "main",          "main + waits",   "decode = mask",   "no decode/MMA", "8 MMA warps",        "k-major",
    "copies from L2", "copies from HBM", "wide from HBM", "wide from L2",  "wide, 1 scale load", "wide, k-major",
    "wide, no x copy", "wide, 2 columns", "wgmma",         "wgmma from HBM", "stream only",  "stream, 1 warp",
    "wide k-maj HBM", "wide 3 rows HBM", "wide 16 tok HBM", "wgmma e4m3",   "wgmma e4m3 HBM",
    "no math HBM",   "copies HBM 6 st", "wide 3 rows 6 st", "copies HBM 3 st", "wide 3 rows 3 st"};
constexpr int kProbeHidden = 3584; /* k3-tp8's H: local x's row pitch */
constexpr int kProbeChunks = 2000;
constexpr uint32_t kProbeChunkBytes = kUnitsPerChunk * kUnitBytes; /* a full FC1 chunk, 17 KB */
constexpr int kSharedSourceChunks = 8, kOwnSourceChunks = 64;
constexpr int kMaxRing = 6;
__host__ __device__ constexpr int ring_stages(int variant) {
  return variant == kCopiesHbm6 || variant == kWide3Hbm6 ? kMaxRing
         : variant == kCopiesHbm3 || variant == kWide3Hbm3 ? 3
                                                            : kStages;
}

/* The probe's random words: a Knuth-multiplied index, its bits mixed (murmur's step). */
__device__ __forceinline__ uint32_t mix_bits(uint32_t h) {
  h ^= h >> 13;
  return h * 0x5bd1e995u;
}

/* One unit's two MMAs (or their stand-in) into d. */
template <int kVariant>
__device__ __forceinline__ void unit_products(uint2 w, uint4 b, float (&d)[4]) {
  if constexpr (kVariant == kNoMma) {
    d[0] = __uint_as_float((w.x ^ b.x ^ b.z) & 0x3BFF3BFFu);
    d[2] = __uint_as_float((w.y ^ b.y ^ b.w) & 0x3BFF3BFFu);
    return;
  }
  uint32_t a_lo[4], a_hi[4];
  if constexpr (kVariant == kOneMask) {
    a_lo[0] = a_lo[1] = a_lo[2] = a_lo[3] = w.x & 0x8E008E00u;
    a_hi[0] = a_hi[1] = a_hi[2] = a_hi[3] = w.y & 0x8E008E00u;
  } else {
    decode_fp4x8(w.x, a_lo);
    decode_fp4x8(w.y, a_hi);
  }
  mma_f16(d, a_lo, b.x, b.y);
  mma_f16(d, a_hi, b.z, b.w);
}

/* A chunk of 4 units that share `act` (k-major) or step through k (the others), as
 * consume_units lays out its loads; sums into acc[unit or 0], every MMA column where kAllColumns.
 * kScales64: the 4 units' scale pairs as one 8-byte load a lane. */
template <int kVariant, bool kShared, bool kScales64, bool kAllColumns>
__device__ __forceinline__ void probe_chunk(uint32_t stage, uint32_t x, const UnitOffsets &o, uint64_t *empty,
                                            float (&acc)[4][4]) {
  constexpr int kWeightStride = kShared ? 16 * kUnitWeightBytes : 4 * kUnitWeightBytes;
  constexpr int kScaleStride = kShared ? 16 * kUnitScaleBytes : 4 * kUnitScaleBytes;
  uint2 w[4];
  uint4 b[4];
  uint32_t sw[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    w[j] = lds64(stage + o.weights + j * kWeightStride);
    if (!kShared || j == 0) b[j] = lds128(x + o.act + j * 4 * kActBlockBytes);
    if (!kScales64) sw[j] = lds16(stage + o.scales + j * kScaleStride);
  }
  if (kScales64) {
    /* 8 bytes at 8 g past the unit's scale block (o.scales is 2 g past it) */
    const uint2 pairs = lds64(stage + o.scales + 6 * ((threadIdx.x >> 2) & 7));
    sw[0] = pairs.x & 0xFFFFu;
    sw[1] = pairs.x >> 16;
    sw[2] = pairs.y & 0xFFFFu;
    sw[3] = pairs.y >> 16;
  }
  mbar_arrive(empty);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 ws = unit_weight_scales(sw[j]); /* rows g and g + 8 */
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    unit_products<kVariant>(w[j], kShared ? b[0] : b[j], d);
    float (&sums)[4] = acc[kShared ? j : 0];
    sums[0] = fmaf(d[0], ws.x, sums[0]);
    sums[2] = fmaf(d[2], ws.y, sums[2]);
    if (kAllColumns) {
      sums[1] = fmaf(d[1], ws.x, sums[1]);
      sums[3] = fmaf(d[3], ws.y, sums[3]);
    }
  }
}

/* ---- wgmma with A from registers (m64n8k16) ------------------------------------------- */
/* x's 8 rows as wgmma's B: for each (stage, k-block, half h of mma_f16's two MMAs), two 8 x 8 f16 core
 * matrices 128 bytes apart (k-major, no swizzle), logical k 0-7 then 8-15, each mapped to the physical k of
 * the row that mma_f16's lanes hold there (lane t: 8 t + e, 8 t + 2 + e, + 4 in the high MMA), so that the
 * decoded A fragments meet the same activations as in consume_units. */
constexpr int kWgmmaHalfBytes = 256, kWgmmaChunkBytes = kFc1ChunkKb * 2 * kWgmmaHalfBytes;

__device__ void build_wgmma_x(const uint8_t *x_rows, uint8_t *xc) {
  constexpr int kValues = kStages * kWgmmaChunkBytes / 2;
  for (int i = threadIdx.x; i < kValues; i += blockDim.x) {
    const int k = i & 15, row = (i >> 4) & 7, half = (i >> 7) & 1, block = i >> 8; /* block: stage * 16 + k-block */
    const int phys = 8 * ((k & 7) >> 1) + 2 * (k >> 3) + (k & 1) + 4 * half;
    const uint16_t v = *reinterpret_cast<const uint16_t *>(x_rows + row * local_x_pitch(kProbeHidden) +
                                                          block * kActBlockBytes + 2 * phys);
    *reinterpret_cast<uint16_t *>(xc + (block * 2 + half) * kWgmmaHalfBytes + (k >> 3) * 128 + row * 16 +
                                  (k & 7) * 2) = v;
  }
}

/* The descriptor of one half's B at addr: leading byte offset 128 (k), stride 256 (unused at n8). */
__device__ __forceinline__ uint64_t kmajor_desc(uint32_t addr) {
  return (uint64_t)((addr & 0x3FFFFu) >> 4) | (uint64_t)(128 >> 4) << 16 | (uint64_t)(256 >> 4) << 32;
}

template <bool kAccumulate>
__device__ __forceinline__ void wgmma_rs_f16(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1, 0;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"((int)kAccumulate));
}

/* The chunk's wgmmas committed and waited for, their sums read only after the wait, then the stage
 * released. */
__device__ __forceinline__ void wgmma_settle(float (&d)[4][4], uint64_t *empty) {
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
#pragma unroll
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 4; ++i) asm volatile("" : "+f"(d[j][i])::"memory");
  mbar_arrive(empty);
}

/* Warp w's 4 units as consume_units lays them out, through its warpgroup (k-slot w / 4, strips w % 4): each
 * unit's two MMAs as two wgmmas, one commit and wait a chunk, the stage released after the wait. */
__device__ __forceinline__ void wgmma_chunk(uint32_t stage, uint32_t xc, const UnitOffsets &o, uint64_t *empty,
                                            float (&acc)[4]) {
  const int k_slot = threadIdx.x >> 7;
  uint2 w[4];
  uint32_t sw[4], a[4][2][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    w[j] = lds64(stage + o.weights + j * 4 * kUnitWeightBytes);
    sw[j] = lds16(stage + o.scales + j * 4 * kUnitScaleBytes);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    decode_fp4x8(w[j].x, a[j][0]);
    decode_fp4x8(w[j].y, a[j][1]);
  }
  float d[4][4] = {};
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t b = xc + (k_slot + 4 * j) * 2 * kWgmmaHalfBytes;
    wgmma_rs_f16<false>(d[j], a[j][0], kmajor_desc(b));
    wgmma_rs_f16<true>(d[j], a[j][1], kmajor_desc(b + kWgmmaHalfBytes));
  }
  wgmma_settle(d, empty);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 ws = unit_weight_scales(sw[j]); /* rows g and g + 8 */
    acc[0] = fmaf(d[j][0], ws.x, acc[0]);
    acc[1] = fmaf(d[j][1], ws.x, acc[1]);
    acc[2] = fmaf(d[j][2], ws.y, acc[2]);
    acc[3] = fmaf(d[j][3], ws.y, acc[3]);
  }
}

/* A wide chunk of units of 16 tokens: each unit's decoded weights multiply two MMA column tiles of x, the
 * first's fragments from act0 (the stage's rows), the second's from act1, into acc[0] and acc[1]. */
__device__ __forceinline__ void wide16_chunk(uint32_t stage, uint32_t act0, uint32_t act1, const UnitOffsets &o,
                                             uint64_t *empty, float (&acc)[4][4]) {
  uint2 w[4];
  uint4 b0[4], b1[4];
  uint32_t sw[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    w[j] = lds64(stage + o.weights + j * 4 * kUnitWeightBytes);
    b0[j] = lds128(act0 + j * 4 * kActBlockBytes);
    b1[j] = lds128(act1 + j * 4 * kActBlockBytes);
    sw[j] = lds16(stage + o.scales + j * 4 * kUnitScaleBytes);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 ws = unit_weight_scales(sw[j]); /* rows g and g + 8 */
    uint32_t a_lo[4], a_hi[4];
    decode_fp4x8(w[j].x, a_lo);
    decode_fp4x8(w[j].y, a_hi);
    float d0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_f16(d0, a_lo, b0[j].x, b0[j].y);
    mma_f16(d0, a_hi, b0[j].z, b0[j].w);
    mma_f16(d1, a_lo, b1[j].x, b1[j].y);
    mma_f16(d1, a_hi, b1[j].z, b1[j].w);
    for (int i = 0; i < 4; ++i) {
      acc[0][i] = fmaf(d0[i], i < 2 ? ws.x : ws.y, acc[0][i]);
      acc[1][i] = fmaf(d1[i], i < 2 ? ws.x : ws.y, acc[1][i]);
    }
  }
  mbar_arrive(empty);
}

/* ---- wgmma e4m3 with A from registers (m64n8k32) -------------------------------------- */
/* x as e4m3 in wgmma's B layout, a k-block (8 rows x 32 codes) as two 8 x 16-byte core matrices 128 bytes
 * apart, then each stage's x scales (a k-block's 8 rows' bytes). Random finite codes and scales near 1. */
constexpr int kWgmma8BlockBytes = 256, kWgmma8ChunkBytes = kFc1ChunkKb * kWgmma8BlockBytes;
constexpr int kWgmma8ScaleOffset = kStages * kWgmma8ChunkBytes, kWgmma8ChunkScales = kFc1ChunkKb * kGroupTokens;
static_assert(kWgmma8ScaleOffset + kStages * kWgmma8ChunkScales <= kStages * kWgmmaChunkBytes, "fits f16's x");

__device__ void build_wgmma8_x(uint8_t *xc) {
  uint32_t *words = reinterpret_cast<uint32_t *>(xc);
  for (int i = threadIdx.x; i < (kWgmma8ScaleOffset + kStages * kWgmma8ChunkScales) / 4; i += blockDim.x) {
    const uint32_t h = mix_bits((uint32_t)i * 2654435761u);
    words[i] = i < kWgmma8ScaleOffset / 4 ? h & 0x77777777u : 0x78787878u | (h & 0x03030303u);
  }
}

/* 8 FP4 codes as 8 e4m3 (each value x 2^-6): the packer would place one nibble of each byte at bits 7, 4,
 * 3, 2 (sign, e1, e0, m: where an e4m3's sign, low exponent bits and top mantissa bit sit) and the other at
 * bits 5, 6, 1, 0 (bits 5, 1, 0 move 2 left, bit 6 two right). */
__device__ __forceinline__ void decode_fp4x8_e4m3(uint32_t w, uint32_t &a, uint32_t &b) {
  a = w & 0x9C9C9C9Cu;
  b = ((w << 2) & 0x8C8C8C8Cu) | ((w >> 2) & 0x10101010u);
}

template <bool kAccumulate>
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
  asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
               "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, p, 1, 1;\n}\n"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"((int)kAccumulate));
}

/* Warp w's 4 units through its warpgroup as wgmma_chunk, each unit one e4m3 wgmma; the sums scaled by the
 * weight scales of rows g, g + 8 times the x scales of columns 2t, 2t + 1. */
__device__ __forceinline__ void wgmma8_chunk(uint32_t stage, uint32_t xc, uint32_t x_scales, const UnitOffsets &o,
                                             uint64_t *empty, float (&acc)[4]) {
  const int k_slot = threadIdx.x >> 7, column = 2 * (threadIdx.x & 3);
  uint2 w[4];
  uint32_t sw[4], sx[4], a[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    w[j] = lds64(stage + o.weights + j * 4 * kUnitWeightBytes);
    sw[j] = lds16(stage + o.scales + j * 4 * kUnitScaleBytes);
    sx[j] = lds16(x_scales + (k_slot + 4 * j) * kGroupTokens + column);
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    decode_fp4x8_e4m3(w[j].x, a[j][0], a[j][1]);
    decode_fp4x8_e4m3(w[j].y, a[j][2], a[j][3]);
  }
  float d[4][4];
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#pragma unroll
  for (int j = 0; j < 4; ++j)
    wgmma_rs_e4m3<false>(d[j], a[j], kmajor_desc(xc + (k_slot + 4 * j) * kWgmma8BlockBytes));
  wgmma_settle(d, empty);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 ws = unit_weight_scales(sw[j]); /* rows g and g + 8 */
    const float x0 = e8m0_to_float_nonzero(sx[j] & 0xFFu), x1 = e8m0_to_float_nonzero(sx[j] >> 8);
    acc[0] = fmaf(d[j][0], ws.x * x0, acc[0]);
    acc[1] = fmaf(d[j][1], ws.x * x1, acc[1]);
    acc[2] = fmaf(d[j][2], ws.y * x0, acc[2]);
    acc[3] = fmaf(d[j][3], ws.y * x1, acc[3]);
  }
}

template <int kVariant, bool kBroadcastX>
__global__ void __launch_bounds__(kThreads, 1) pace_kernel(const uint8_t *source, unsigned long long *cycles,
                                                           float *sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr bool kHalf = kVariant == kHalfWarps, kStream = kVariant == kStreamOnly || kVariant == kStreamOneWarp;
  constexpr int kMmaWarps = kVariant == kStreamOneWarp ? 1 : kHalf ? kConsumerWarps / 2 : kConsumerWarps;
  constexpr bool kWide3 = kVariant == kWide3Hbm || kVariant == kWide3Hbm6 || kVariant == kWide3Hbm3;
  constexpr bool kWideHbmAny = kVariant == kWideHbm || kVariant == kWideKMajorHbm || kWide3 || kVariant == kWide16Hbm;
  constexpr bool kKMajorWide = kVariant == kWideKMajor || kVariant == kWideKMajorHbm;
  constexpr bool kWide = kWideHbmAny || kKMajorWide || kVariant == kWideL2 || kVariant == kWideScales ||
                         kVariant == kWideNoX || kVariant == kWideTwoCols;
  constexpr int kXRows = kWide3 ? 3 : kGroupTokens; /* x rows copied into each stage */
  constexpr int kRing = ring_stages(kVariant);
  constexpr bool kXCopies = kWide && kVariant != kWideNoX;
  constexpr bool kWgmmaAny = kVariant == kWgmma || kVariant == kWgmmaHbm;
  constexpr bool kWgmma8Any = kVariant == kWgmma8 || kVariant == kWgmma8Hbm;
  constexpr bool kCopies = kVariant == kCopiesL2 || kVariant == kCopiesHbm || kVariant == kCopiesHbm6 ||
                           kVariant == kCopiesHbm3 || kVariant == kWgmmaHbm || kVariant == kWgmma8Hbm ||
                           kVariant == kNoMmaHbm || kStream || kWide;
  constexpr bool kFromL2 = kVariant == kCopiesL2 || (kWide && !kWideHbmAny);
  /* the ring's stages of words whose scale bytes stay below 0xFF, then x as finite f16 */
  uint32_t *words = reinterpret_cast<uint32_t *>(smem);
  const int stage_words = kRing * kStageBytes / 4, x_words = kGroupTokens * local_x_pitch(kProbeHidden) / 4;
  for (int i = threadIdx.x; i < stage_words + x_words; i += blockDim.x) {
    const uint32_t h = mix_bits((uint32_t)i * 2654435761u ^ blockIdx.x * 97u);
    words[i] = h & (i < stage_words ? 0x7F7F7F7Fu : 0x3BFF3BFFu);
  }
  constexpr int kFullArrivals = kXCopies ? 2 : 1;
  __shared__ uint64_t empty[kMaxRing], full[kMaxRing];
  if (threadIdx.x < kRing) {
    mbar_init(&empty[threadIdx.x], kMmaWarps * 32);
    /* main + waits: never arrived, so a wait on parity 1 passes at once; wide: the activation warp arrives too */
    mbar_init(&full[threadIdx.x], kFullArrivals);
  }
  fence_barrier_init();
  __syncthreads();
  uint8_t *const x_rows = smem + kRing * kStageBytes;
  uint8_t *const xc = x_rows + kGroupTokens * local_x_pitch(kProbeHidden) + kLocalXOverread + 128;
  if (kWgmmaAny) {
    build_wgmma_x(x_rows, xc);
    __syncthreads();
  }
  if (kWgmma8Any) {
    build_wgmma8_x(xc);
    __syncthreads();
  }
  constexpr int kActBytes = kFc1ChunkKb * kActBlockBytes; /* a token row of one chunk */
  if (kXCopies && warp == kActivationWarp) { /* the activation producer: a stage's 8 token rows */
    RingPos pos;
    for (int c = 0; c < kProbeChunks; ++c, pos.advance(kRing)) {
      mbar_wait(&empty[pos.stage], pos.parity ^ 1);
      if (lane == 0) mbar_arrive_expect_tx(&full[pos.stage], kXRows * kActBytes);
      __syncwarp(); /* the bytes are expected before any can land */
      if (lane < kXRows)
        bulk_copy(smem + pos.stage * kStageBytes + kStageActOffset + lane * kActRowBytes,
                  source + (size_t)(lane * kOwnSourceChunks + c % kOwnSourceChunks) * kActBytes, kActBytes,
                  &full[pos.stage]);
    }
    return;
  }
  if (kCopies && warp == kWeightWarp) { /* the kernel's weight producer: one bulk copy a stage */
    if (lane != 0) return;
    RingPos pos;
    for (int c = 0; c < kProbeChunks; ++c, pos.advance(kRing)) {
      const int chunk = kFromL2 ? c % kSharedSourceChunks : blockIdx.x * kOwnSourceChunks + c % kOwnSourceChunks;
      mbar_wait(&empty[pos.stage], pos.parity ^ 1);
      mbar_arrive_expect_tx(&full[pos.stage], kProbeChunkBytes);
      bulk_copy(smem + pos.stage * kStageBytes, source + (size_t)chunk * kProbeChunkBytes, kProbeChunkBytes,
                &full[pos.stage]);
    }
    return;
  }
  if (warp >= kMmaWarps) return;
  const uint32_t stages = smem_addr(smem), x_local = stages + kRing * kStageBytes;
  const uint32_t released = x_local + kGroupTokens * local_x_pitch(kProbeHidden) + kLocalXOverread; /* consume_units' */
  const int x_row = kBroadcastX ? 0 : lane >> 2;
  /* the kernel's FC1 plan (consumer_plan): strip = warp % 4, k-slot = warp / 4; k-major: k-block = warp */
  UnitOffsets o = kVariant == kKMajor ? unit_offsets(kFc1Strips, 0, warp, kFc1ChunkKb, kActRowBytes)
                                      : unit_offsets(kFc1Strips, warp & 3, warp >> 2, kFc1ChunkKb, kActRowBytes);
  o.act = x_row * local_x_pitch(kProbeHidden) + (kVariant == kKMajor ? warp : warp >> 2) * kActBlockBytes +
          16 * (lane & 3);
  if (kWide) /* x in the stage */
    o = kKMajorWide ? unit_offsets(kFc1Strips, 0, warp, kFc1ChunkKb, kActRowBytes)
                    : unit_offsets(kFc1Strips, warp & 3, warp >> 2, kFc1ChunkKb, kActRowBytes);
  float acc[4][4] = {};
  __syncwarp();
  const long long t0 = clock64();
  const unsigned long long ns0 = global_ns();
#pragma unroll 1
  for (int c = 0; c < kProbeChunks; ++c) {
    const int s = c % kRing;
    const uint32_t stage = stages + s * kStageBytes, x = x_local + s * kFc1ChunkKb * kActBlockBytes;
    if constexpr (kVariant == kMainWait) mbar_wait(&full[s], 1);
    if constexpr (kCopies) mbar_wait(&full[s], (c / kRing) & 1);
    if constexpr (kStream) {
      mbar_arrive(&empty[s]);
      continue;
    }
    if constexpr (kVariant == kWideScales || kKMajorWide)
      probe_chunk<kMain, kKMajorWide, kVariant == kWideScales, true>(stage, stage, o, &empty[s], acc);
    else if constexpr (kVariant == kWide16Hbm)
      wide16_chunk(stage, stage + o.act, x + x_row * local_x_pitch(kProbeHidden) + (warp >> 2) * kActBlockBytes +
                   16 * (lane & 3), o, &empty[s], acc);
    else if constexpr (kWide)
      consume_units<4, 4, false, kVariant == kWideTwoCols>(stage, stage, o, 0, released, &empty[s], acc[0]);
    else if constexpr (kVariant == kNoMmaHbm)
      probe_chunk<kNoMma, false, false, false>(stage, x, o, &empty[s], acc);
    else if constexpr (kVariant == kMain || kVariant == kMainWait || kCopies)
      consume_units<4, 4, false, true>(stage, x, o, 0, released, &empty[s], acc[0]);
    else if constexpr (kWgmmaAny)
      wgmma_chunk(stage, smem_addr(xc) + s * kWgmmaChunkBytes, o, &empty[s], acc[0]);
    else if constexpr (kWgmma8Any)
      wgmma8_chunk(stage, smem_addr(xc) + s * kWgmma8ChunkBytes,
                   smem_addr(xc) + kWgmma8ScaleOffset + s * kWgmma8ChunkScales, o, &empty[s], acc[0]);
    else if constexpr (kHalf)
      consume_units<8, 2, false, true>(stage, x, o, 0, released, &empty[s], acc[0]);
    else
      probe_chunk<kVariant, kVariant == kKMajor, false, false>(stage, x, o, &empty[s], acc);
  }
  const long long t1 = clock64();
  const unsigned long long ns1 = global_ns();
  if (lane == 0) {
    cycles[2 * (blockIdx.x * kConsumerWarps + warp)] = t1 - t0;
    cycles[2 * (blockIdx.x * kConsumerWarps + warp) + 1] = ns1 - ns0;
  }
  float total = 0.0f;
  for (int j = 1; j < 4; ++j) total += acc[j][0] + acc[j][2];
  /* MMA column 0's sums (every variant that keeps them in acc[0]: main and wgmma compare), the rest live */
  sink[2 * (blockIdx.x * kConsumerThreads + threadIdx.x)] = acc[0][0] + total;
  sink[2 * (blockIdx.x * kConsumerThreads + threadIdx.x) + 1] = acc[0][2];
}

struct Pace {
  double cycles, ghz; /* a chunk's cycles and the SM clock, medians over every warp of 5 launches */
};

/* Words of pace_kernel's cycles buffer: (cycles, ns) for every MMA warp. */
static size_t warp_words(int grid) { return 2 * (size_t)grid * kConsumerWarps; }

/* Every reporting warp's cycles a chunk and clock, over the launches added. */
struct WarpPaces {
  std::vector<double> per_chunk, ghz;

  /* The warps of the launch that last wrote d_cycles. */
  void add(int grid, const unsigned long long *d_cycles) {
    std::vector<unsigned long long> h(warp_words(grid));
    CHECK(cudaMemcpy(h.data(), d_cycles, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < h.size(); i += 2)
      if (h[i]) {
        per_chunk.push_back((double)h[i] / kProbeChunks);
        ghz.push_back((double)h[i] / (double)h[i + 1]);
      }
  }
  Pace median() const {
    if (per_chunk.empty()) {
      fprintf(stderr, "pace_kernel: no warp reported\n");
      exit(1);
    }
    return Pace{::median(per_chunk), ::median(ghz)};
  }
};

template <int kVariant, bool kBroadcastX>
Pace pace(int grid, size_t smem_bytes, const uint8_t *source, unsigned long long *d_cycles, float *d_sink) {
  const auto kernel = pace_kernel<kVariant, kBroadcastX>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes));
  WarpPaces paces;
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaMemset(d_cycles, 0, warp_words(grid) * sizeof(unsigned long long)));
    kernel<<<grid, kThreads, smem_bytes>>>(source, d_cycles, d_sink);
    CHECK(cudaGetLastError());
    paces.add(grid, d_cycles);
  }
  return paces.median();
}

/* NVML through dlopen (the driver's library, no link-time dependency): the board's energy counter,
 * SM clock and clock event reasons, for the sustained table. */
struct Nvml {
  void *dev = nullptr;
  int (*energy_mj)(void *, unsigned long long *) = nullptr;
  int (*clock_mhz)(void *, int, unsigned *) = nullptr;
  int (*event_reasons)(void *, unsigned long long *) = nullptr;

  bool open() {
    void *lib = dlopen("libnvidia-ml.so.1", RTLD_NOW);
    if (!lib) return false;
    auto init = (int (*)())dlsym(lib, "nvmlInit_v2");
    auto by_bus = (int (*)(const char *, void **))dlsym(lib, "nvmlDeviceGetHandleByPciBusId_v2");
    energy_mj = (int (*)(void *, unsigned long long *))dlsym(lib, "nvmlDeviceGetTotalEnergyConsumption");
    clock_mhz = (int (*)(void *, int, unsigned *))dlsym(lib, "nvmlDeviceGetClockInfo");
    event_reasons = (int (*)(void *, unsigned long long *))dlsym(lib, "nvmlDeviceGetCurrentClocksThrottleReasons");
    char bus[32];
    CHECK(cudaDeviceGetPCIBusId(bus, sizeof bus, 0));
    return init && by_bus && energy_mj && clock_mhz && event_reasons && init() == 0 && by_bus(bus, &dev) == 0;
  }
  unsigned long long energy() const {
    unsigned long long mj = 0;
    energy_mj(dev, &mj);
    return mj;
  }
};
constexpr int kNvmlClockSm = 1;
constexpr unsigned long long kSwPowerCap = 0x4, kHwSlowdown = 0x8;

static double seconds_now() {
  timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

struct Sustained {
  Pace pace;              /* the last launch's */
  double watts, uj_chunk; /* the board's mean power over the timed part, and its energy per chunk (all SMs') */
  double chunks_us, mhz;  /* chunks a us over the grid; NVML's SM clock, median of the samples */
  int capped, samples;    /* samples with the SW power cap or a HW slowdown among the clock event reasons */
};

/* kVariant launched back to back for `seconds` (the board settles), then for `seconds` more timed
 * against the board's energy counter. */
template <int kVariant>
Sustained sustain(int grid, size_t smem_bytes, const uint8_t *source, unsigned long long *d_cycles, float *d_sink,
                  const Nvml &nvml, double seconds) {
  const auto kernel = pace_kernel<kVariant, false>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes));
  constexpr int kBatch = 16;
  auto batch = [&] {
    for (int i = 0; i < kBatch; ++i) kernel<<<grid, kThreads, smem_bytes>>>(source, d_cycles, d_sink);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
  };
  for (const double start = seconds_now(); seconds_now() - start < seconds;) batch();
  Sustained r{};
  std::vector<double> mhz;
  long launches = 0;
  const unsigned long long e0 = nvml.energy();
  const double t0 = seconds_now();
  while (seconds_now() - t0 < seconds) {
    batch();
    launches += kBatch;
    unsigned clock = 0;
    unsigned long long reasons = 0;
    nvml.clock_mhz(nvml.dev, kNvmlClockSm, &clock);
    nvml.event_reasons(nvml.dev, &reasons);
    mhz.push_back(clock);
    r.capped += (reasons & (kSwPowerCap | kHwSlowdown)) != 0;
  }
  const double elapsed = seconds_now() - t0, joules = 1e-3 * (double)(nvml.energy() - e0);
  const double chunks = (double)launches * grid * kProbeChunks;
  WarpPaces paces;
  paces.add(grid, d_cycles);
  r.pace = paces.median();
  r.watts = joules / elapsed;
  r.uj_chunk = 1e6 * joules / chunks;
  r.chunks_us = chunks / (1e6 * elapsed);
  r.mhz = median(mhz);
  r.samples = (int)mhz.size();
  return r;
}

/* MMA column 0's sums of wgmma against main's (x 8 rows), the largest relative difference. */
static double wgmma_against_main(int grid, size_t smem_bytes, const uint8_t *source, unsigned long long *d_cycles,
                                 float *d_sink) {
  const size_t n = 2 * (size_t)grid * kConsumerThreads;
  std::vector<float> main_sums(n), wgmma_sums(n);
  pace<kMain, false>(grid, smem_bytes, source, d_cycles, d_sink);
  CHECK(cudaMemcpy(main_sums.data(), d_sink, n * sizeof(float), cudaMemcpyDeviceToHost));
  pace<kWgmma, false>(grid, smem_bytes, source, d_cycles, d_sink);
  CHECK(cudaMemcpy(wgmma_sums.data(), d_sink, n * sizeof(float), cudaMemcpyDeviceToHost));
  double worst = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double a = main_sums[i], b = wgmma_sums[i], scale = std::max(std::fabs(a), 1e-30);
    worst = std::max(worst, a == b ? 0.0 : std::fabs(a - b) / scale); /* NaN fails below */
    if (a != a || b != b) return INFINITY;
  }
  return worst;
}

/* The e4m3 wgmma's sums (x 8 rows): how many of them are finite and how many nonzero, of n. */
static void wgmma8_sums(int grid, size_t smem_bytes, const uint8_t *source, unsigned long long *d_cycles,
                        float *d_sink) {
  const size_t n = 2 * (size_t)grid * kConsumerThreads;
  std::vector<float> sums(n);
  pace<kWgmma8, false>(grid, smem_bytes, source, d_cycles, d_sink);
  CHECK(cudaMemcpy(sums.data(), d_sink, n * sizeof(float), cudaMemcpyDeviceToHost));
  size_t finite = 0, nonzero = 0;
  for (float v : sums) {
    finite += std::isfinite(v);
    nonzero += v != 0.0f;
  }
  printf("wgmma e4m3's sums: %zu of %zu finite, %zu nonzero\n", finite, n, nonzero);
}

/* Every variant, in the order of Variant. */
template <bool kBroadcastX, int... kVariant>
void measure(int grid, size_t smem_bytes, const uint8_t *source, unsigned long long *d_cycles, float *d_sink,
             Pace (&out)[kVariants], std::integer_sequence<int, kVariant...>) {
  ((out[kVariant] = pace<kVariant, kBroadcastX>(grid, smem_bytes, source, d_cycles, d_sink)), ...);
}

/* The sustained table's variants: resident data, then fed from HBM. */
template <int... kVariant>
using Seq = std::integer_sequence<int, kVariant...>;
using SustainedVariants = Seq<kMain, kKMajor, kOneMask, kNoMma, kWgmma, kWideL2, kWideKMajor, kWideNoX, kWideTwoCols,
                              kStreamOnly, kStreamOneWarp, kCopiesHbm, kWgmmaHbm, kWideHbm, kWideKMajorHbm, kWide3Hbm,
                              kWide16Hbm, kWgmma8, kWgmma8Hbm, kNoMmaHbm, kCopiesHbm6, kWide3Hbm6, kCopiesHbm3,
                              kWide3Hbm3>;

template <int... kVariant>
void sustained_table(int grid, size_t smem_bytes, const uint8_t *source, unsigned long long *d_cycles, float *d_sink,
                     double seconds, const std::vector<int> &only, Seq<kVariant...>) {
  Nvml nvml;
  if (!nvml.open()) {
    printf("sustained table: NVML not found, skipped\n");
    return;
  }
  const unsigned long long e0 = nvml.energy();
  const double t0 = seconds_now();
  sleep(1);
  const double idle_w = 1e-3 * (double)(nvml.energy() - e0) / (seconds_now() - t0);
  printf("\nSustained (%.1f s a variant settling, %.1f s timed; three passes, the second in reverse order); the board "
         "idle for 1 s before: %.0f W; dyn: the energy a chunk over that\n", seconds, seconds, idle_w);
  printf("  %-16s %4s %9s %5s %6s %5s %8s %8s %9s %7s\n", "variant", "pass", "cyc/chunk", "GHz", "SM MHz", "W",
         "uJ/chunk", "dyn uJ", "chunks/us", "capped");
  constexpr int kCount = sizeof...(kVariant);
  const int order[kCount] = {kVariant...};
  for (int pass = 0; pass < 3; ++pass)
    for (int i = 0; i < kCount; ++i) {
      const int v = order[pass == 1 ? kCount - 1 - i : i];
      if (!only.empty() && std::find(only.begin(), only.end(), v) == only.end()) continue;
      Sustained r{};
      ((v == kVariant ? (void)(r = sustain<kVariant>(grid, smem_bytes, source, d_cycles, d_sink, nvml, seconds))
                      : (void)0),
       ...);
      printf("  %-16s %4d %9.1f %5.2f %6.0f %5.0f %8.3f %8.3f %9.1f %3d/%-3d\n", kVariantNames[v], pass + 1,
             r.pace.cycles, r.pace.ghz, r.mhz, r.watts, r.uj_chunk, (r.watts - idle_w) / r.chunks_us, r.chunks_us,
             r.capped, r.samples);
      fflush(stdout);
    }
}

/* n words of hashed bits under mask */
__global__ void fill_hashed(uint32_t *words, size_t n, uint32_t mask) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t h = mix_bits((uint32_t)i * 2654435761u);
    words[i] = (h ^ h >> 15) & mask;
  }
}

}  // namespace
}  // namespace kx

int main(int argc, char **argv) {
  using namespace kx;
  double sustain_s = 0.0;
  std::vector<int> only; /* the sustained table's variants by their index in Variant; all when empty */
  bool constant = false;
  for (int i = 1; i < argc; ++i)
    if (!strcmp(argv[i], "--sustain") && i + 1 < argc)
      sustain_s = atof(argv[++i]);
    else if (!strcmp(argv[i], "--only") && i + 1 < argc)
      for (char *tok = strtok(argv[++i], ","); tok; tok = strtok(nullptr, ",")) only.push_back(atoi(tok));
    else if (!strcmp(argv[i], "--constant"))
      constant = true;
    else {
      fprintf(stderr, "usage: %s [--sustain SECONDS [--only I,J,..]] [--constant]\n", argv[0]);
      return 2;
    }
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  /* the ring, x's rows, then wgmma's x (4-stage variants) or the deeper ring's stages */
  const size_t smem_bytes = kStages * kStageBytes + kGroupTokens * local_x_pitch(kProbeHidden) + kLocalXOverread + 128 +
                            std::max(kStages * kWgmmaChunkBytes, (kMaxRing - kStages) * kStageBytes);
  Dev cycles(warp_words(sms) * sizeof(unsigned long long)),
      sink(2 * (size_t)sms * kConsumerThreads * sizeof(float));
  /* the copies' source: hashed words whose FP4 codes are positive, scales at most 2^-8, f16 finite;
   * --constant: every byte 0x35 (FP4 pairs 3 and 5, scales 2^-74), what toggles nothing */
  const size_t source_bytes = (size_t)sms * kOwnSourceChunks * kProbeChunkBytes;
  Dev source(source_bytes);
  if (constant)
    CHECK(cudaMemset(source.p, 0x35, source_bytes));
  else
    fill_hashed<<<sms * 4, 256>>>(source.as<uint32_t>(), source_bytes / 4, 0x77777777u);
  CHECK(cudaGetLastError());
  const auto variants = std::make_integer_sequence<int, kVariants>();
  Pace rows[kVariants], broadcast[kVariants];
  measure<false>(sms, smem_bytes, source.as<uint8_t>(), cycles.as<unsigned long long>(), sink.as<float>(), rows,
                 variants);
  measure<true>(sms, smem_bytes, source.as<uint8_t>(), cycles.as<unsigned long long>(), sink.as<float>(), broadcast,
                variants);
  printf("MMA warps' cycles per FC1 chunk (17 KB): %d CTAs, %d chunks, median warp (SM clock, GHz)\n", sms,
         kProbeChunks);
  printf("  %-16s %16s %16s\n", "variant", "x 8 rows", "x broadcast");
  for (int v = 0; v < kVariants; ++v)
    printf("  %-16s %9.1f (%4.2f) %9.1f (%4.2f)\n", kVariantNames[v], rows[v].cycles, rows[v].ghz, broadcast[v].cycles,
           broadcast[v].ghz);
  printf("wgmma's MMA column 0 sums against main's (x 8 rows): largest relative difference %.3g\n",
         wgmma_against_main(sms, smem_bytes, source.as<uint8_t>(), cycles.as<unsigned long long>(), sink.as<float>()));
  wgmma8_sums(sms, smem_bytes, source.as<uint8_t>(), cycles.as<unsigned long long>(), sink.as<float>());
  if (sustain_s > 0)
    sustained_table(sms, smem_bytes, source.as<uint8_t>(), cycles.as<unsigned long long>(), sink.as<float>(),
                    sustain_s, only, SustainedVariants());
  return 0;
}
