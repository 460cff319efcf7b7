/* pipeline.cuh: the few sm_90 primitives the kernels are built from, written once.
 *
 * - mbarrier ring: producer warps fill shared-memory stages with bulk copies
 *   (cp.async.bulk, completion counted in bytes on the stage's "full" barrier);
 *   consumer warps arrive on the stage's "empty" barrier when done with it.
 * - cross-CTA hand-off through global counters with release/acquire at GPU scope.
 * - programmatic dependent launch (griddepcontrol).
 * - thread-block clusters: rank, barrier, another CTA's shared memory.
 */
#pragma once

#include <stdint.h>

namespace kx {

__device__ __forceinline__ uint32_t smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* ---- mbarriers ---- */
__device__ __forceinline__ void mbar_init(uint64_t *bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(arrivals));
}

/* The initialized barriers become visible to the cluster and to the copy engine (async
 * proxy), which counts bytes on them. */
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t *bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

/* `count` arrivals at once: one thread standing in for several that have nothing to add. */
__device__ __forceinline__ void mbar_arrive(uint64_t *bar, uint32_t count) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(count)
               : "memory");
}

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;"
               ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

/* Blocks until the phase with this parity has completed. */
__device__ __forceinline__ void mbar_wait(uint64_t *bar, uint32_t parity) {
  uint32_t addr = smem_addr(bar);
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}"
      ::"r"(addr), "r"(parity) : "memory");
}

/* ---- bulk copies global -> shared, counted on an mbarrier ---- */
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

/* Bulk copy global -> shared counted on an mbarrier, for data read once (weights): ask
 * L2 to drop it first. bytes % 16 == 0, both addresses 16-byte aligned. */
__device__ __forceinline__ void bulk_copy_streaming(void *dst, const void *src, uint32_t bytes,
                                                    uint64_t *bar, uint64_t policy) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1], %2, [%3], %4;"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)), "l"(policy) : "memory");
}

/* bytes (a multiple of 16, both ends 16-byte aligned) global -> shared by the copy engine,
 * default L2 policy: activations are read again by other CTAs. */
__device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

/* Global data this thread acquired (written by other CTAs through ordinary stores) becomes
 * visible to its later copy-engine reads, which go through the async proxy. */
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

/* ---- cross-CTA counters and flags (GPU scope) ---- */
__device__ __forceinline__ unsigned int load_acquire(const unsigned int *p) {
  unsigned int v;
  asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned long long load_acquire(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void store_release(unsigned long long *p, unsigned long long v) {
  asm volatile("st.release.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

/* Words that carry their own validity (a tag) need no ordering, only atomicity. */
__device__ __forceinline__ void store_relaxed(unsigned long long *p, unsigned long long v) {
  asm volatile("st.relaxed.gpu.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ unsigned long long load_relaxed(const unsigned long long *p) {
  unsigned long long v;
  asm volatile("ld.relaxed.gpu.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ unsigned int load_relaxed(const unsigned int *p) {
  unsigned int v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

/* %globaltimer in ns: one clock for every SM (clock64 is per SM) */
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

/* %clock64 (this SM's cycles) with a memory clobber: not moved across the loads and stores around it */
__device__ __forceinline__ long long clock_now() {
  long long t;
  asm volatile("mov.u64 %0, %%clock64;" : "=l"(t)::"memory");
  return t;
}

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

/* *p += v, relaxed: a reduction (the thread does not wait for its round trip); a fence before it
 * makes it a release. */
__device__ __forceinline__ void red_add_relaxed_gpu(int *p, int v) {
  asm volatile("red.relaxed.gpu.global.add.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

/* Spins until a counter that only grows has reached target, modulo 2^32 (it may wrap).
 * Data values are never used as flags (SPEC 7), only counters and call numbers. */
__device__ __forceinline__ void wait_count(const unsigned int *p, unsigned int target) {
  while ((int)(load_acquire(p) - target) < 0) __nanosleep(64);
}

/* Spins until *p == v. */
__device__ __forceinline__ void wait_equal(const unsigned long long *p, unsigned long long v) {
  while (load_acquire(p) != v) __nanosleep(64);
}

/* ---- a place in a ring of stages: the slot, and the parity of the barrier phase a
 * wait there is for (it flips each time the ring wraps around) ---- */
struct RingPos {
  int stage = 0;
  uint32_t parity = 0;
  __device__ __forceinline__ void advance(int stages) {
    if (++stage == stages) {
      stage = 0;
      parity ^= 1u;
    }
  }
};

/* ---- named barrier among a subset of warps (id 0 is __syncthreads) ---- */
__device__ __forceinline__ void named_barrier(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* Arrives on a named barrier without waiting for it: the threads that bar.sync on it go
 * once all have arrived, and see what the arriving threads wrote before. */
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* ---- thread-block clusters ---- */
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}

/* The cluster barrier, split: every thread of every CTA of the cluster arrives once, then
 * waits once (before it writes to another CTA's shared memory, or leaves). */
__device__ __forceinline__ void cluster_arrive() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

/* All threads of all CTAs of the cluster; release/acquire orders their shared-memory writes. */
__device__ __forceinline__ void cluster_sync() {
  cluster_arrive();
  cluster_wait();
}

/* The address `addr` of this CTA's shared memory has in CTA `rank` of the cluster. */
__device__ __forceinline__ uint32_t cluster_addr(uint32_t addr, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
  return remote;
}

/* ---- programmatic dependent launch ---- */
__device__ __forceinline__ void wait_for_predecessor() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
}

__device__ __forceinline__ void allow_dependents() {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

}  // namespace kx
