/* moe_layout.cuh: the kernel layout of the expert weights, shared by the packer and
 * the experts kernel (host and device).
 *
 * Both GEMMs of an expert are cut the same way. A "unit" is 16 weight rows x 32 k
 * (the A operands of two MMA m16n8k16, one E8M0 scale per row): 256 bytes of FP4
 * stored so that lane l's 8 bytes at offset 8 l are exactly its fragments (decode_fp4x8
 * turns each word into one MMA's four f16x2 registers), followed elsewhere by 16 scale bytes
 * (row g at byte 2g, row g+8 at byte 2g+1, so each lane reads one u16).
 * A "strip" is 16 rows; a "tile" is `strips` strips over all of K; a "chunk" is the
 * part of a tile one pipeline stage carries: chunk_kb k-blocks of every strip,
 * weights [strip][kb][256 B] then scales [strip][kb][16 B], one contiguous bulk copy.
 * A chunk carries at most 64 units (17 KB), and a tile's chunks are cut equal (72
 * k-blocks in 16s: 4 x 15 + 12, not 4 x 16 + 8): the copy engine's cost is per copy, and measured
 * on an H200 one CTA per SM streams 2.2 TB/s in 4 KB copies, 4.3 in 8 KB, 4.65 in 16 KB.
 *
 *   FC1 tile: strips 2j, 2j+1 = gate rows 16(2f+j).., up rows I+16(2f+j).. (SiTU needs
 *             both), j = 0, 1: 16-k-block chunks of 17 KB, half the activation
 *             bytes per weight byte of one pair's 28-block chunks, and half the tiles
 *             (-3 to -9 % at B >= 16, session 18)
 *   FC2 tile: 4 strips = output rows 16*strips*f .., doubled to 8 or 16 while the tile
 *             is under 32 KB and H allows: HBM streams small tiles scattered over
 *             many experts slower (H200, one CTA per SM: 2.9 TB/s in random 13 KB
 *             pieces, 4.2 in random 61 KB pieces, 4.3 sequential)
 * Every chunk shape carries at most 64 units, so the experts kernel's 16 MMA warps split
 * every stage evenly (4 units each).
 * The packed bytes equal the standard layout's (no padding): E * (2I*H/2 + 2I*H/32
 * + H*I/2 + H*I/32).
 */
#pragma once

#include <stdint.h>

#ifndef __CUDACC__
#error "moe_layout.cuh is CUDA C (nvcc); csrc/ reaches the kernels through kimi_kernels.h only"
#endif
#define KX_HOST_DEVICE __host__ __device__ __forceinline__

namespace kx {

constexpr int kStripRows = 16;
constexpr int kUnitWeightBytes = kStripRows * 32 / 2; /* 256 */
constexpr int kUnitScaleBytes = kStripRows;           /* 16 */
constexpr int kUnitBytes = kUnitWeightBytes + kUnitScaleBytes;
constexpr int kUnitsPerChunk = 64;
constexpr int kFc1Strips = 4, kFc1ChunkKb = kUnitsPerChunk / kFc1Strips; /* 16 k-blocks */
constexpr int kFc1Pairs = kFc1Strips / 2; /* gate/up pairs per FC1 tile */
/* The most k-blocks a chunk spans (FC1's 16; FC2's 4, 8 or 16): a stage's activation rows
 * hold that many (26 KB stages; 34 KB ones with room for 32 were no faster, session 19). */
constexpr int kMaxChunkKb = kFc1ChunkKb;
static_assert(kUnitsPerChunk / 4 <= kMaxChunkKb, "FC2's chunks (4 strips or more) fit a stage's rows too");
constexpr int kChunkMaxBytes = kUnitsPerChunk * kUnitBytes;
constexpr int kMinLargeTileBytes = 32 * 1024;
static_assert(kUnitBytes % 16 == 0, "bulk copies move multiples of 16 bytes");

/* Where the packer puts the nibbles of one 32-bit word so that decode_fp4x8 (mx.cuh)
 * is cheap. f16x2 register i takes each nibble's sign at bit 15 / 31 and its magnitude
 * e1 e0 m at 11..9 / 27..25 (mask 0x8E008E00). Register 0 is the word masked, register 1
 * the word shifted left by 8, registers 2 and 3 the same of the word's bit reversal
 * (BREV): the four patterns tile the 32 bits, so a word costs 1 BREV + 2 shifts (IMAD,
 * FMA pipe) + 4 LOP3, where sign and magnitude taken apart cost 6 LOP3 + 5 IMAD.
 * Returns the word bit that lands on bit p of register i. */
KX_HOST_DEVICE constexpr int nibble_word_bit(int i, int p) {
  return i == 0 ? p : i == 1 ? p - 8 : i == 2 ? 31 - p : 39 - p;
}

/* One GEMM of the layer in tile terms. */
struct PhaseShape {
  int strips;      /* strips per tile */
  int chunk_kb;    /* k-blocks per full chunk */
  int k_blocks;    /* K / 32 */
  int tiles;       /* tiles per expert */
  int n_chunks;    /* chunks per tile */
  uint64_t tiles_inv; /* ceil(2^40 / tiles): n / tiles without a division, see per_tiles */
  int64_t expert_bytes;
  int64_t base;    /* offset of this phase's region in the packed buffer */

  KX_HOST_DEVICE int chunks() const { return n_chunks; }
  /* n / tiles for 0 <= n < 2^24 (tiles < 2^16: the rounding of tiles_inv stays below
   * 1 / tiles); the kernels split tile indices this way on every role's hot path. */
  KX_HOST_DEVICE int per_tiles(int n) const { return (int)(((uint64_t)n * tiles_inv) >> 40); }
  KX_HOST_DEVICE int chunk_k_blocks(int c) const {
    int left = k_blocks - c * chunk_kb;
    return left < chunk_kb ? left : chunk_kb;
  }
  KX_HOST_DEVICE int64_t tile_bytes() const { return (int64_t)strips * k_blocks * kUnitBytes; }
  /* Byte offset of chunk c of tile f of expert e. */
  KX_HOST_DEVICE int64_t chunk_offset(int e, int f, int c) const {
    return base + e * expert_bytes + f * tile_bytes() + (int64_t)strips * c * chunk_kb * kUnitBytes;
  }
  KX_HOST_DEVICE uint32_t chunk_bytes(int c) const {
    return (uint32_t)(strips * chunk_k_blocks(c) * kUnitBytes);
  }
};

/* max_kb: the most k-blocks a chunk of this phase may carry. */
KX_HOST_DEVICE void finish_phase(PhaseShape *p, int max_kb) {
  const int fewest = (p->k_blocks + max_kb - 1) / max_kb;
  p->chunk_kb = (p->k_blocks + fewest - 1) / fewest;
  p->n_chunks = (p->k_blocks + p->chunk_kb - 1) / p->chunk_kb; /* no empty last chunk */
  p->tiles_inv = (((uint64_t)1 << 40) + (uint64_t)p->tiles - 1) / (uint64_t)p->tiles;
}

KX_HOST_DEVICE PhaseShape fc1_shape(int experts, int hidden, int inter) {
  PhaseShape p;
  p.strips = kFc1Strips;
  p.k_blocks = hidden / 32;
  p.tiles = inter / (kStripRows * kFc1Pairs);
  finish_phase(&p, kFc1ChunkKb);
  p.expert_bytes = (int64_t)p.tiles * p.tile_bytes();
  p.base = 0;
  (void)experts;
  return p;
}

KX_HOST_DEVICE PhaseShape fc2_shape(int experts, int hidden, int inter) {
  PhaseShape p;
  p.k_blocks = inter / 32;
  /* the most strips (4, 8, 16: one per MMA warp at most) that H allows while a smaller
   * tile stays under kMinLargeTileBytes */
  p.strips = 4;
  while (p.strips < 16 && p.strips * p.k_blocks * kUnitBytes < kMinLargeTileBytes &&
         hidden % (2 * p.strips * kStripRows) == 0)
    p.strips *= 2;
  p.tiles = hidden / (p.strips * kStripRows);
  finish_phase(&p, kUnitsPerChunk / p.strips);
  p.expert_bytes = (int64_t)p.tiles * p.tile_bytes();
  p.base = (int64_t)experts * fc1_shape(experts, hidden, inter).expert_bytes;
  return p;
}

/* Weight row (in the standard layout's matrix) of strip s of tile f. FC1: strips 2j, 2j + 1
 * are the gate and up rows of hidden columns 16 (kFc1Pairs f + j).. */
KX_HOST_DEVICE int fc1_row(int inter, int f, int s) {
  return (s & 1 ? inter : 0) + (f * kFc1Pairs + (s >> 1)) * kStripRows;
}
KX_HOST_DEVICE int fc2_row(int strips, int f, int s) { return (f * strips + s) * kStripRows; }

}  // namespace kx
