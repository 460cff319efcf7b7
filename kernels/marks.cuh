/* marks.cuh: clock stamps of each CTA's progress through the experts kernel, for timing studies
 * (benchmarks/experts_marks.cu). Compiled in only with -DKX_MARKS; otherwise every KX_MARK is
 * nothing and the kernel is the library's.
 *
 * Thread 0 of each CTA (lane 0 of MMA warp 0) stamps clock64() into its CTA's row of
 * kMarkSlots words (the points of MarkSlot) and kMarksPerTile words per tile, at the tile's
 * launch-wide index (tile i is CTA i % grid's; tiles past kMarkMaxTiles are not kept), so a
 * stamp costs no division; lane 0 of the router / weight warp, of an activation warp and of an
 * epilogue warp stamp the routing's, the copies' and the epilogues' slots.
 * Nothing is stamped inside the MMA warps' chunk loops, whose schedule the stamps would change,
 * but for two clock reads around each full wait (KX_TIMED_WAIT, summed per tile); the copy
 * warps stamp a tile's first chunks only. Each launch overwrites the words it reaches, so a
 * reader clears them before the launch it reads.
 * The enums are host code too (the harness names the slots with them). */
#pragma once

#include <cuda_runtime_api.h>

#include "pipeline.cuh" /* global_ns */

namespace kx {

enum MarkSlot {
  kMarkEntry,       /* first instruction */
  kMarkWaited,      /* griddepcontrol.wait returned: the predecessor is done */
  kMarkRouted,      /* the routing tables are complete */
  kMarkFc1Done,     /* the MMA warps left FC1's tiles */
  kMarkFc2Planned,  /* the MMA warps' FC2 plan is made, before its first stage wait */
  kMarkExit,        /* the MMA warps' last tile is handed off */
  kMarkWaitedNs,    /* %globaltimer (ns) at kMarkWaited and when the MMA warps are done (after a combined */
  kMarkExitNs,      /* launch's combine, experts_combine.cuh): the CTAs on one clock */
  kMarkNanDone,     /* write_nan_rows is done (stamped by a warp that writes them) */
  kMarkFc1Planned,  /* the MMA warps' FC1 plan is made */
  kMarkFirstCopy,   /* the weight warp issued its first copy */
  kMarkFirstFc2Copy, /* the weight warp issued its first FC2 tile's first copy */
  kMarkFc2ActStage, /* the first FC2 tile's first chunk: its activation warp has the stage */
  kMarkFc2ActDone,  /* ... and has copied or gathered its activations */
  kMarkFirstFull,   /* the ring's first stage is full (seen by an epilogue warp, idle then) */
  kMarkRouterTables, /* one-token launches: the router warp wrote the tables (ids loaded and matched) */
  kMarkRouterSynced, /* ... and passed the routing group's barrier */
  kMarkWeightsEnter, /* the weight warp entered its stream, before its first tile's lookups */
  kMarkWeightsLooked, /* ... and has its first tile's expert, before its first stage wait */
  kMarkPrologue,    /* the MMA warps' part before the predecessor wait is done (warm pass, clear) */
  kMarkEntryNs,     /* %globaltimer at kMarkEntry */
  kMarkBarriersInit, /* thread 0 initialized the CTA's mbarriers */
  kMarkWarmed,      /* the MMA warps' warm pass is done (one-token launches), before the clear */
  kMarkActStage,    /* activation warps 0 and 1 have the ring's first stage (each arrives on it next) */
  kMarkActStage1,
  /* launches of several tokens, before the tiles: */
  kMarkRouteDone,   /* the routing group's thread 0 left route_launch (before the CTA barrier) */
  kMarkXCounted,    /* the MMA warps' thread 0 quantized its rows of x and counted them */
  kMarkPastJoin,    /* the weight warp passed the CTA barrier that joins routing and x */
  kMarkXSeen,       /* activation warp 0 saw every CTA's x counted */
  kMarkTilesDoneNs, /* %globaltimer: the MMA warps left their tiles (before a combined launch's combine) */
  kMarkCombinePolledNs, /* ... MMA warp 0's first poll of its last strip's (piece's) row words returned */
  kMarkCombineSeenNs, /* ... and it has them all tagged, after kMarkCombinePolls polls (a count) */
  kMarkCombinePolls,
  kMarkCombineSummedNs, /* ... and has summed them, before its stores */
  kMarkTilesDone,      /* clock64 at kMarkTilesDoneNs; then MMA warp 0's first combine item: */
  kMarkCombineIssued,  /* ... its first poll's loads about to issue (the item's code and lookups behind it) */
  kMarkCombineBack,    /* ... and back (clock64 at kMarkCombinePolledNs) */
  kMarkSlots = 37,
};
static_assert(kMarkCombineBack + 1 == kMarkSlots, "every slot has its word");

constexpr int kMarkSeenChunks = 3; /* a tagged FC2 tile's chunks whose hand-off is stamped */

enum TileMark {
  kMarkTileEnter, /* the loop's top, before the tile's lookups */
  kMarkTileStart, /* before its first chunk's stage wait */
  kMarkTileData,  /* its first stage is full (waited for outside the loop, marks builds only) */
  kMarkTileSums,  /* its chunks' MMAs done */
  kMarkTileDone,  /* its sums handed to an epilogue warp (or its rows stored) */
  kMarkTileCta,   /* not a clock: the CTA that ran it, plus 1 */
  kMarkTileParked,   /* its epilogue warp found every MMA warp's sums parked */
  kMarkTileEpilogue, /* ... and had stored them (its rows, or h / the tagged hidden words) */
  /* these on %globaltimer (ns), since they are compared across CTAs (kMarkTilePolls: a count): */
  kMarkTileStored, /* FC1 tiles: the epilogue warp stored h (tagged launches: its hidden words) */
  kMarkTileSeen,   /* tagged FC2 tiles: chunk c's hidden words seen and widened, at kMarkTileSeen + c (c < 3) */
  kMarkTilePolled = kMarkTileSeen + kMarkSeenChunks,   /* ... its activation warp began polling them (ns) */
  kMarkTilePolls = kMarkTilePolled + kMarkSeenChunks,  /* ... and how many polls it took (a count, not a clock) */
  /* tagged FC1 tiles, clock64 on the epilogue warp, between kMarkTileParked and kMarkTileEpilogue: */
  kMarkTileSummed = kMarkTilePolls + kMarkSeenChunks, /* the partial sums loaded and added (gate and up) */
  kMarkTileActivated,                   /* SiTU done */
  /* launches of several tokens, %globaltimer (ns): */
  kMarkTileReleased, /* FC1: this tile was its unit's last, and its epilogue warp released the unit's hidden rows */
  kMarkTileReady,    /* FC2: its activation warp knows the unit's hidden rows are released (its poll, or one before) */
  /* counts, not clocks (MMA warp 0, lane 0): */
  kMarkTileWaits,  /* cycles in the full waits of the tile's chunks, summed */
  kMarkTileChunks, /* the tile's chunks */
};

constexpr int kMarksPerTile = kMarkTileChunks + 1;
constexpr int kMarkMaxCtas = 1024, kMarkMaxTiles = 1 << 16;

#ifdef KX_MARKS
/* this translation unit's */
static __device__ unsigned long long g_marks[kMarkMaxCtas * kMarkSlots];
static __device__ unsigned long long g_tile_marks[kMarkMaxTiles * kMarksPerTile];

__device__ __forceinline__ void mark_by_caller(int slot, unsigned long long value) {
  if (slot < kMarkSlots) g_marks[blockIdx.x * kMarkSlots + slot] = value;
}

__device__ __forceinline__ void mark_at(int slot, unsigned long long value) {
  if (threadIdx.x == 0) mark_by_caller(slot, value);
}

#define KX_MARK(slot) ::kx::mark_at((slot), clock64())
#define KX_MARK_NS(slot) ::kx::mark_at((slot), ::kx::global_ns())
#define KX_MARK_VALUE(slot, value) ::kx::mark_at((slot), (value))
/* stamped by the calling thread (the caller picks one), if cond */
#define KX_MARK_BY_IF(cond, slot) \
  do { if (cond) ::kx::mark_by_caller((slot), clock64()); } while (0)
/* marks builds only: if cond, the calling thread waits (a statement), then stamps */
#define KX_MARK_BY_IF_AFTER(cond, wait, slot) \
  do { if (cond) { wait; ::kx::mark_by_caller((slot), clock64()); } } while (0)

__device__ __forceinline__ void mark_tile_by_caller(int index, int k, unsigned long long value) {
  if (index < kMarkMaxTiles) g_tile_marks[index * kMarksPerTile + k] = value;
}

__device__ __forceinline__ void mark_tile(int index, int k, unsigned long long value) {
  if (threadIdx.x == 0) mark_tile_by_caller(index, k, value);
}

/* mark k (TileMark) of the tile at launch-wide index; the enter mark also names the CTA */
#define KX_MARK_TILE(index, k) ::kx::mark_tile((index), (k), clock64())
/* %globaltimer stamped by the calling thread (the caller picks one), if cond */
#define KX_MARK_TILE_NS_BY_IF(cond, index, k) \
  do { if (cond) ::kx::mark_tile_by_caller((index), (k), ::kx::global_ns()); } while (0)
/* clock64() stamped by the calling thread, if cond */
#define KX_MARK_TILE_BY_IF(cond, index, k) \
  do { if (cond) ::kx::mark_tile_by_caller((index), (k), clock64()); } while (0)
/* clock64() stamped by the calling thread once v (a float) is computed, if cond: a compare that
 * never holds reads v first, so the stamp is not issued before v's loads and arithmetic */
static __device__ unsigned int g_mark_sink;
#define KX_MARK_TILE_AFTER_VALUE_BY_IF(cond, index, k, v)                                  \
  do {                                                                                    \
    if (cond) {                                                                           \
      if (__float_as_uint(v) == 0xFFFFFFFFu) ::kx::g_mark_sink = 1;                      \
      ::kx::mark_tile_by_caller((index), (k), clock64());                                 \
    }                                                                                     \
  } while (0)
/* a value (not a clock) stored by the calling thread, if cond */
#define KX_MARK_TILE_VALUE_BY_IF(cond, index, k, value) \
  do { if (cond) ::kx::mark_tile_by_caller((index), (k), (value)); } while (0)
#define KX_MARK_TILE_ENTER(index) \
  do {                                                                    \
    KX_MARK_TILE(index, ::kx::kMarkTileEnter);                            \
    ::kx::mark_tile((index), ::kx::kMarkTileCta, blockIdx.x + 1);         \
  } while (0)
/* marks builds only: wait (a statement), then stamp */
#define KX_MARK_TILE_AFTER(wait, index, k) do { wait; KX_MARK_TILE(index, k); } while (0)
/* a tile's full waits timed and summed (the statement alone outside marks builds) */
#define KX_WAITS_DECLARE unsigned long long kx_waits_ = 0
#define KX_TIMED_WAIT(wait)                  \
  do {                                       \
    const long long kx_t0_ = clock64();      \
    wait;                                    \
    kx_waits_ += clock64() - kx_t0_;         \
  } while (0)
#define KX_MARK_TILE_WAITS(index, chunks)                                \
  do {                                                                   \
    ::kx::mark_tile((index), ::kx::kMarkTileWaits, kx_waits_);           \
    ::kx::mark_tile((index), ::kx::kMarkTileChunks, (chunks));           \
  } while (0)
#else
#define KX_MARK(slot) ((void)0)
#define KX_MARK_NS(slot) ((void)0)
#define KX_MARK_VALUE(slot, value) ((void)(value))
#define KX_MARK_BY_IF(cond, slot) ((void)0)
#define KX_MARK_BY_IF_AFTER(cond, wait, slot) ((void)0)
#define KX_MARK_TILE(index, k) ((void)0)
#define KX_MARK_TILE_ENTER(index) ((void)0)
#define KX_MARK_TILE_NS_BY_IF(cond, index, k) ((void)0)
#define KX_MARK_TILE_BY_IF(cond, index, k) ((void)0)
#define KX_MARK_TILE_VALUE_BY_IF(cond, index, k, value) ((void)(value))
#define KX_MARK_TILE_AFTER_VALUE_BY_IF(cond, index, k, v) ((void)0)
#define KX_MARK_TILE_AFTER(wait, index, k) ((void)0)
#define KX_WAITS_DECLARE ((void)0)
#define KX_TIMED_WAIT(wait) wait
#define KX_MARK_TILE_WAITS(index, chunks) ((void)0)
#endif

}  // namespace kx

#ifdef KX_MARKS
/* experts.cu's marks, cleared before a launch (on its stream) and read after it: the grid's
 * first `ctas` rows of kMarkSlots words, and the first `tiles` tiles' kMarksPerTile words */
extern "C" cudaError_t kx_marks_clear(cudaStream_t stream);
extern "C" cudaError_t kx_marks_read(unsigned long long *host, int ctas, unsigned long long *tile_host, int tiles);
#endif
