/* marks.cuh: clock stamps of each CTA's progress through the experts kernel, for timing studies
 * (benchmarks/experts_marks.cu). Compiled in only with -DKX_MARKS; otherwise every KX_MARK is
 * nothing and the kernel is the library's.
 *
 * Thread 0 of each CTA (lane 0 of MMA warp 0) stamps clock64() into its CTA's row of
 * kMarkSlots words: the fixed points of MarkSlot, then one word per chunk as its stage turned
 * full, kMarksPerTile per tile of the CTA (the n-th tile's chunk c at kMarkChunks +
 * n * kMarksPerTile + c; later tiles and chunks past the row are not kept). Each launch
 * overwrites the words it reaches, so a reader clears them before the launch it reads. The
 * enum is host code too (the harness names the slots with it). */
#pragma once

#include <stdint.h>
#include <cuda_runtime_api.h>

namespace kx {

enum MarkSlot {
  kMarkEntry,       /* first instruction */
  kMarkWaited,      /* griddepcontrol.wait returned: the predecessor is done */
  kMarkRouted,      /* the routing tables are complete */
  kMarkFc1Done,     /* the MMA warps left FC1's tiles */
  kMarkFc2Planned,  /* the MMA warps' FC2 plan is made, before its first stage wait */
  kMarkExit,        /* the MMA warps' last tile is handed off */
  kMarkWaitedNs,    /* %globaltimer (ns) at kMarkWaited and at kMarkExit: the CTAs on one clock */
  kMarkExitNs,
  kMarkChunks = 10,
  kMarksPerTile = 8,
  kMarkSlots = 72,  /* 7 tiles of chunks */
  kMarkMaxCtas = 1024,
};

#ifdef KX_MARKS
static __device__ unsigned long long g_marks[kMarkMaxCtas * kMarkSlots]; /* this translation unit's */

__device__ __forceinline__ void mark_at(int slot, unsigned long long value) {
  if (threadIdx.x == 0 && slot < kMarkSlots) g_marks[blockIdx.x * kMarkSlots + slot] = value;
}

__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

#define KX_MARK(slot) ::kx::mark_at((slot), clock64())
#define KX_MARK_NS(slot) ::kx::mark_at((slot), ::kx::global_ns())
/* KX_MARK_TILE at a tile's start (index: this CTA's tiles are blockIdx.x, + gridDim.x, ...), then
 * KX_MARK_CHUNK(c) as its chunk c's stage is full */
#define KX_MARK_TILE(index) \
  const int kx_mark_row = ::kx::kMarkChunks + ((index) - (int)blockIdx.x) / (int)gridDim.x * ::kx::kMarksPerTile
#define KX_MARK_CHUNK(c) \
  ::kx::mark_at(kx_mark_row + ((c) < ::kx::kMarksPerTile ? (c) : ::kx::kMarksPerTile - 1), clock64())
#else
#define KX_MARK(slot) ((void)0)
#define KX_MARK_NS(slot) ((void)0)
#define KX_MARK_TILE(index) ((void)0)
#define KX_MARK_CHUNK(c) ((void)0)
#endif

}  // namespace kx

#ifdef KX_MARKS
/* experts.cu's marks, cleared before a launch (on its stream) and read after it: the grid's
 * first `ctas` rows of kMarkSlots words */
extern "C" cudaError_t kx_marks_clear(cudaStream_t stream);
extern "C" cudaError_t kx_marks_read(unsigned long long *host, int ctas);
#endif
