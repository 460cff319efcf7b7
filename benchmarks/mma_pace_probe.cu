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
 * each with x's fragments from 8 token rows (launches of several tokens) or all lanes reading
 * row 0 (a one-token launch's broadcast).
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels \
 *        benchmarks/mma_pace_probe.cu kernels/pack.cu kernels/quantize.cu kernels/probe.cu -o /tmp/pace
 */
#include "../kernels/experts.cu"

#include <stdio.h>

#include <utility>
#include <vector>

#include "harness.cuh"

namespace kx {
namespace {

enum Variant {
  kMain, kMainWait, kOneMask, kNoMma, kHalfWarps, kKMajor, kCopiesL2, kCopiesHbm,
  kWideHbm, kWideL2, kWideScales, kWideKMajor, kWideNoX, kWideTwoCols, kVariants
};
const char *const kVariantNames[kVariants] = {
    "main",          "main + waits",   "decode = mask",   "no decode/MMA", "8 MMA warps",        "k-major",
    "copies from L2", "copies from HBM", "wide from HBM", "wide from L2",  "wide, 1 scale load", "wide, k-major",
    "wide, no x copy", "wide, 2 columns"};
constexpr int kProbeHidden = 3584; /* k3-tp8's H: local x's row pitch */
constexpr int kProbeChunks = 2000;
constexpr uint32_t kProbeChunkBytes = kUnitsPerChunk * kUnitBytes; /* a full FC1 chunk, 17 KB */
constexpr int kSharedSourceChunks = 8, kOwnSourceChunks = 64;

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
    const float sw_g = fabsf(__uint_as_float(sw[j] << 23)), sw_g8 = e8m0_to_float_nonzero(sw[j] >> 8);
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    unit_products<kVariant>(w[j], kShared ? b[0] : b[j], d);
    float (&sums)[4] = acc[kShared ? j : 0];
    sums[0] = fmaf(d[0], sw_g, sums[0]);
    sums[2] = fmaf(d[2], sw_g8, sums[2]);
    if (kAllColumns) {
      sums[1] = fmaf(d[1], sw_g, sums[1]);
      sums[3] = fmaf(d[3], sw_g8, sums[3]);
    }
  }
}

template <int kVariant, bool kBroadcastX>
__global__ void __launch_bounds__(kThreads, 1) pace_kernel(const uint8_t *source, unsigned long long *cycles,
                                                           float *sink) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr bool kHalf = kVariant == kHalfWarps;
  constexpr bool kWide = kVariant == kWideHbm || kVariant == kWideL2 || kVariant == kWideScales ||
                         kVariant == kWideKMajor || kVariant == kWideNoX || kVariant == kWideTwoCols;
  constexpr bool kXCopies = kWide && kVariant != kWideNoX;
  constexpr bool kCopies = kVariant == kCopiesL2 || kVariant == kCopiesHbm || kWide;
  constexpr bool kFromL2 = kVariant == kCopiesL2 || (kWide && kVariant != kWideHbm);
  /* 4 stages of words whose scale bytes stay below 0xFF, then x as finite f16 */
  uint32_t *words = reinterpret_cast<uint32_t *>(smem);
  const int stage_words = kStages * kStageBytes / 4, x_words = kGroupTokens * local_x_pitch(kProbeHidden) / 4;
  for (int i = threadIdx.x; i < stage_words + x_words; i += blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ blockIdx.x * 97u;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    words[i] = h & (i < stage_words ? 0x7F7F7F7Fu : 0x3BFF3BFFu);
  }
  constexpr int kFullArrivals = kXCopies ? 2 : 1;
  __shared__ uint64_t empty[kStages], full[kStages];
  if (threadIdx.x < kStages) {
    mbar_init(&empty[threadIdx.x], kConsumerThreads);
    /* main + waits: never arrived, so a wait on parity 1 passes at once; wide: the activation warp arrives too */
    mbar_init(&full[threadIdx.x], kFullArrivals);
  }
  fence_barrier_init();
  __syncthreads();
  constexpr int kActBytes = kFc1ChunkKb * kActBlockBytes; /* a token row of one chunk */
  if (kXCopies && warp == kActivationWarp) { /* the activation producer: a stage's 8 token rows */
    RingPos pos;
    for (int c = 0; c < kProbeChunks; ++c, pos.advance(kStages)) {
      mbar_wait(&empty[pos.stage], pos.parity ^ 1);
      if (lane == 0) mbar_arrive_expect_tx(&full[pos.stage], kGroupTokens * kActBytes);
      __syncwarp(); /* the bytes are expected before any can land */
      if (lane < kGroupTokens)
        bulk_copy(smem + pos.stage * kStageBytes + kStageActOffset + lane * kActRowBytes,
                  source + (size_t)(lane * kOwnSourceChunks + c % kOwnSourceChunks) * kActBytes, kActBytes,
                  &full[pos.stage]);
    }
    return;
  }
  if (kCopies && warp == kWeightWarp) { /* the kernel's weight producer: one bulk copy a stage */
    if (lane != 0) return;
    RingPos pos;
    for (int c = 0; c < kProbeChunks; ++c, pos.advance(kStages)) {
      const int chunk = kFromL2 ? c % kSharedSourceChunks : blockIdx.x * kOwnSourceChunks + c % kOwnSourceChunks;
      mbar_wait(&empty[pos.stage], pos.parity ^ 1);
      mbar_arrive_expect_tx(&full[pos.stage], kProbeChunkBytes);
      bulk_copy(smem + pos.stage * kStageBytes, source + (size_t)chunk * kProbeChunkBytes, kProbeChunkBytes,
                &full[pos.stage]);
    }
    return;
  }
  if (warp >= (kHalf ? kConsumerWarps / 2 : kConsumerWarps)) return;
  const uint32_t stages = smem_addr(smem), x_local = stages + kStages * kStageBytes;
  const uint32_t released = x_local + kGroupTokens * local_x_pitch(kProbeHidden) + kLocalXOverread; /* consume_units' */
  const int x_row = kBroadcastX ? 0 : lane >> 2;
  /* the kernel's FC1 plan (consumer_plan): strip = warp % 4, k-slot = warp / 4; k-major: k-block = warp */
  UnitOffsets o = kVariant == kKMajor ? unit_offsets(kFc1Strips, 0, warp, kFc1ChunkKb, kActRowBytes)
                                      : unit_offsets(kFc1Strips, warp & 3, warp >> 2, kFc1ChunkKb, kActRowBytes);
  o.act = x_row * local_x_pitch(kProbeHidden) + (kVariant == kKMajor ? warp : warp >> 2) * kActBlockBytes +
          16 * (lane & 3);
  if (kWide) /* x in the stage */
    o = kVariant == kWideKMajor ? unit_offsets(kFc1Strips, 0, warp, kFc1ChunkKb, kActRowBytes)
                                : unit_offsets(kFc1Strips, warp & 3, warp >> 2, kFc1ChunkKb, kActRowBytes);
  float acc[4][4] = {};
  __syncwarp();
  const long long t0 = clock64();
  const unsigned long long ns0 = global_ns();
#pragma unroll 1
  for (int c = 0; c < kProbeChunks; ++c) {
    const int s = c & (kStages - 1);
    const uint32_t stage = stages + s * kStageBytes, x = x_local + s * kFc1ChunkKb * kActBlockBytes;
    if constexpr (kVariant == kMainWait) mbar_wait(&full[s], 1);
    if constexpr (kCopies) mbar_wait(&full[s], (c / kStages) & 1);
    if constexpr (kVariant == kWideScales || kVariant == kWideKMajor)
      probe_chunk<kMain, kVariant == kWideKMajor, kVariant == kWideScales, true>(stage, stage, o, &empty[s], acc);
    else if constexpr (kWide)
      consume_units<4, 4, false, kVariant == kWideTwoCols>(stage, stage, o, 0, released, &empty[s], acc[0]);
    else if constexpr (kVariant == kMain || kVariant == kMainWait || kCopies)
      consume_units<4, 4, false, true>(stage, x, o, 0, released, &empty[s], acc[0]);
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
  for (int j = 0; j < 4; ++j) total += acc[j][0] + acc[j][2];
  if (total == 1.2345f) sink[threadIdx.x] = total; /* keeps the sums live */
}

struct Pace {
  double cycles, ghz; /* a chunk's cycles and the SM clock, medians over every warp of 5 launches */
};

template <int kVariant, bool kBroadcastX>
Pace pace(int grid, size_t smem_bytes, const uint8_t *source, unsigned long long *d_cycles, float *d_sink) {
  const auto kernel = pace_kernel<kVariant, kBroadcastX>;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem_bytes));
  std::vector<double> per_chunk, ghz;
  std::vector<unsigned long long> h(2 * (size_t)grid * kConsumerWarps);
  for (int rep = 0; rep < 5; ++rep) {
    CHECK(cudaMemset(d_cycles, 0, h.size() * sizeof(h[0])));
    kernel<<<grid, kThreads, smem_bytes>>>(source, d_cycles, d_sink);
    CHECK(cudaGetLastError());
    CHECK(cudaMemcpy(h.data(), d_cycles, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < h.size(); i += 2)
      if (h[i]) {
        per_chunk.push_back((double)h[i] / kProbeChunks);
        ghz.push_back((double)h[i] / (double)h[i + 1]);
      }
  }
  if (per_chunk.empty()) {
    fprintf(stderr, "pace_kernel: no warp reported\n");
    exit(1);
  }
  return Pace{median(per_chunk), median(ghz)};
}

/* Every variant, in the order of Variant. */
template <bool kBroadcastX, int... kVariant>
void measure(int grid, size_t smem_bytes, const uint8_t *source, unsigned long long *d_cycles, float *d_sink,
             Pace (&out)[kVariants], std::integer_sequence<int, kVariant...>) {
  ((out[kVariant] = pace<kVariant, kBroadcastX>(grid, smem_bytes, source, d_cycles, d_sink)), ...);
}

}  // namespace
}  // namespace kx

int main() {
  using namespace kx;
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const size_t smem_bytes = kStages * kStageBytes + kGroupTokens * local_x_pitch(kProbeHidden) + kLocalXOverread + 16;
  Dev cycles(2 * (size_t)sms * kConsumerWarps * sizeof(unsigned long long)), sink(kThreads * sizeof(float));
  /* the copies' source: 0x35 bytes are valid FP4 pairs (3 and 5) and scales (2^-74) */
  const size_t source_bytes = (size_t)sms * kOwnSourceChunks * kProbeChunkBytes;
  Dev source(source_bytes);
  CHECK(cudaMemset(source.p, 0x35, source_bytes));
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
  return 0;
}
