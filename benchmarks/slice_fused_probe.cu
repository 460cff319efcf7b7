/* slice_fused_probe.cu: a skeleton of k3-tp8's launches of one or two tokens, timed before anyone
 * builds it, and the same skeleton as a measure of B = 1's stream alone. A stand-alone study (not
 * part of the library build):
 *
 *   nvcc -gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -Ikernels -Ibenchmarks \
 *        benchmarks/slice_fused_probe.cu kernels/probe.cu -o /tmp/slice_fused_probe && \
 *        /tmp/slice_fused_probe
 *
 * Why: at B = 1 the experts kernel ends with a chain that no deal has shortened (sessions 20-35):
 * an expert's FC2 tiles need all of its hidden row, so its last FC1 tile's epilogue, the hand-off
 * through L2 and three FC2 chunks of MMAs follow the stream. Here an item is one 32-column slice of
 * I (one MXFP8 block of the hidden row) of one expert, split over a cluster of `ways` CTAs: each
 * streams FC1's 64 rows (gate and up) over 1/ways of K = H, the cluster swaps the 64 partial sums
 * through DSMEM, every CTA has the slice's 32 hidden values (SiTU and the block's quantization are
 * local), and streams FC2's rows over 1/ways of H for those 32 columns of K. No CTA waits on
 * another expert's FC1; what is left is a deterministic sum of the slices' FC2 partials at the end
 * (each item's CTA adds a 1/slices share of its rows once every slice of them is in). The deal is
 * even (items of ~91 KB round-robin over the clusters), where the kernel's is not.
 *
 * The skeleton streams the real bytes (FP4 + E8M0 scales, as if laid out item by item: the
 * packed layout would have to change for that), in the kernel's ring (4 stages, evict-first bulk
 * copies, one producer lane), and stands in for the math with spins: a start spin (the routing),
 * a spin per chunk on each of 4 consumer warps (the MMA warps' pace), a spin after the swap
 * (SiTU and quantization). The partial rows and the final sums are real stores and loads. Cases
 * switch the swap and the sums off (the stream alone), change the ring, claim half-items from a
 * counter, drop PDL or the L2 hint, and stamp the producer's start. Each prints the time per layer
 * (graph of 8 layers with PDL, 8 weight sets rotated), the floor from the HBM read rate measured in
 * the same run, and medians of stamps after the layer's first wait.
 *
 * Session 36 (results/experts-session36-h200.log): the stream alone is 11.6-11.9 us a layer
 * (1.51-1.54x its floor), and with a 2000-cycle start and 720 cycles a chunk (the kernel's routing
 * and MMA pace) 14.6-14.8, where the kernel reads 14.2; the slice-fused structure is slower than
 * the kernel (21.5-21.8 us with the same spins: its swap and its sums cost more than the hand-off).
 */
#include <cuda_bf16.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <random>
#include <vector>

#include "harness.cuh"
#include "pipeline.cuh"

namespace {

constexpr int kMaxStages = 8;
constexpr int kChunk = 17 * 896;          /* bytes: 896 FC2 rows x 32 columns (FP4 + scales) */
/* The experts kernel's k3-tp8 tiles (`tiles` below): an expert's 12 FC1 tiles (64 rows over H) of 7
 * chunks, then its 14 FC2 tiles (256 rows over I) of 3, every chunk 17 KB. */
constexpr int kTileChunk = 17408, kFc1Tiles = 12, kFc1TileChunks = 7, kFc2Tiles = 14, kFc2TileChunks = 3;
constexpr size_t kExpertBytes = (size_t)kTileChunk * (kFc1Tiles * kFc1TileChunks + kFc2Tiles * kFc2TileChunks);
constexpr int kMaxChunk = kTileChunk;
constexpr int kConsumerWarps = 4;
constexpr int kConsumers = 32 * kConsumerWarps;
constexpr int kThreads = 32 * (1 + kConsumerWarps + 1); /* producer, consumers, epilogue */
constexpr int kSumRows = 64;              /* FC1 rows of a slice: 32 gate, 32 up */
constexpr int kMaxWays = 4;
constexpr int kMaxSlices = 12;
constexpr int kMaxPartRows = 1792;        /* H / ways */
constexpr int kMaxItems = 64;             /* a CTA's */
/* named barriers: the consumers among themselves, a partial row parked (by buffer), its buffer free */
constexpr uint32_t kBarConsumers = 1, kBarParked = 2, kBarFree = 4, kBarEnd = 6;
constexpr int kLayers = 8;
/* the producer's start: its first id loaded, the L2 policy made, the first copy's empty wait and
 * expect_tx done, its first four copies issued */
constexpr int kStartMarks = 8;
constexpr int kSmemBytes = 200 * 1024;    /* one CTA per SM */

struct Shape {
  int H, I, E;
};

struct Params {
  const uint8_t *w;      /* [E][slices][ways][item bytes] */
  const int *ids;        /* [units] distinct experts */
  float *partials;       /* [units][slices][ways][H / ways] */
  __nv_bfloat16 *out;    /* [units][H] */
  unsigned *done;        /* [units][ways]: slices' partials stored, grows by `slices` a launch */
  unsigned long long *stamps; /* [grid][4] globaltimer: waited, first stage full, items done, exit */
  long long *starts;     /* [grid][kStartMarks] the producer lane's clock64 after its wait (see kStartMarks) */
  int units, slices, ways, H;
  int start_spin, fc1_spin, fc2_spin, swap_spin; /* cycles */
  bool swap, sums; /* the cluster's swap; the partial rows, their count and the sum over slices */
  int stages;      /* the ring's */
  bool release_first; /* consumers free a stage before their spin (as the MMA warps do after their shared loads) */
  /* dynamic: each CTA claims half-items (one CTA's share of an item) from `claims`, one ahead,
   * until none are left: a stream alone (no swap, no sums); the next layer zeroes the counter
   * after its wait */
  bool dynamic;
  unsigned *claims, *claims_before;
  bool hint; /* the weights' copies ask L2 to evict them first (the experts kernel's do) */
  bool skip_first_waits; /* the first lap's copies go without the empty barrier's (trivial) wait */
  /* tiles: the stream walks the experts kernel's tiles (k3-tp8) instead of items: FC1's of every
   * unit, then FC2's, unit by unit, round-robin over the grid (its static deal), a stream alone */
  bool tiles;
  long long *clocks; /* CTA 0's clock64 cycles and globaltimer ns from its wait to its end: the SM clock */
  long long *turns;  /* [grid][4] consumer warp 0's cycles summed over its chunks: in the full wait, in the spin,
                      * in the syncwarp and arrive, and the chunk count */
};

struct Shared {
  uint64_t full[kMaxStages], empty[kMaxStages], swapped[2]; /* by item parity (see the swap) */
  float swap[2][kMaxWays][kSumRows];
  float parked[2][kMaxPartRows];   /* an item's FC2 partial row, for the epilogue warp */
  unsigned targets[kMaxItems];     /* each item's count once all its slices are in */
  bool last[kMaxStages];           /* dynamic: the stage holds no chunk, the stream has ended */
  int sink;                        /* a loaded value stored here has arrived */
  alignas(128) uint8_t stage[kMaxStages][kMaxChunk];
};

using kx::clock_now;

__device__ __forceinline__ void spin(int cycles) {
  const long long t0 = clock64();
  while (clock64() - t0 < cycles) {
  }
}

__device__ __forceinline__ uint32_t cluster_index() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
  return r;
}

/* this CTA's shared variable `local` in CTA `rank` of the cluster */
__device__ __forceinline__ uint32_t remote(const void *local, uint32_t rank) {
  return kx::cluster_addr(kx::smem_addr(local), rank);
}

__device__ __forceinline__ void swap_wait(uint64_t *bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred done;\n"
      "WAIT_%=:\n"
      " mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n"
      " @!done bra WAIT_%=;\n}" ::"r"(kx::smem_addr(bar)),
      "r"(parity)
      : "memory");
}

__global__ void __launch_bounds__(kThreads, 1) slice_fused(Params p) {
  extern __shared__ __align__(128) uint8_t smem_raw[];
  Shared &sh = *reinterpret_cast<Shared *>(smem_raw);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const uint32_t rank = kx::cluster_rank();
  const int clusters = gridDim.x / p.ways, items = p.units * p.slices;
  const int part_rows = p.H / p.ways;                 /* FC2 rows of one CTA's share */
  const int fc2_chunks = part_rows / 896, fc1_chunks = 2 * fc2_chunks;
  const size_t item_bytes = (size_t)(fc1_chunks + fc2_chunks) * kChunk;
  kx::allow_dependents();
  if (threadIdx.x == 0) {
    for (int s = 0; s < p.stages; ++s) {
      sh.last[s] = false;
      kx::mbar_init(&sh.full[s], 1);
      kx::mbar_init(&sh.empty[s], kConsumerWarps);
    }
    for (int b = 0; b < 2; ++b) kx::mbar_init(&sh.swapped[b], kSumRows * (p.ways - 1));
    kx::fence_barrier_init();
  }
  kx::cluster_sync(); /* the partners' swap barriers exist before anyone arrives on them */
  kx::wait_for_predecessor();
  unsigned long long *stamp = p.stamps + (size_t)blockIdx.x * 4;
  if (threadIdx.x == 0) stamp[0] = kx::global_ns();
  const long long clock_at_wait = clock_now();
  if (p.dynamic && blockIdx.x == 0 && threadIdx.x == 0) *p.claims_before = 0; /* that layer is done */

  if (warp == 0) {
    if (lane == 0) {
      const long long waited = clock_now();
      long long marks[kStartMarks] = {};
      int issued = 0;
      spin(p.start_spin);
      *(volatile int *)&sh.sink = p.ids[cluster_index() % p.units]; /* the store waits for the load */
      marks[0] = clock_now() - waited;
      const uint64_t policy = p.hint ? kx::l2_evict_first_policy() : 0;
      marks[1] = clock_now() - waited;
      kx::RingPos pos;
      const auto stream = [&](const uint8_t *src, int chunks, int chunk) {
        for (int c = 0; c < chunks; ++c, pos.advance(p.stages)) {
          if (!p.skip_first_waits || issued >= p.stages) kx::mbar_wait(&sh.empty[pos.stage], pos.parity ^ 1u);
          if (issued == 0) marks[2] = clock_now() - waited;
          kx::mbar_arrive_expect_tx(&sh.full[pos.stage], chunk);
          if (issued == 0) marks[3] = clock_now() - waited;
          uint8_t *dst = sh.stage[pos.stage];
          if (p.hint)
            kx::bulk_copy_streaming(dst, src + (size_t)c * chunk, chunk, &sh.full[pos.stage], policy);
          else
            kx::bulk_copy(dst, src + (size_t)c * chunk, chunk, &sh.full[pos.stage]);
          if (issued < kStartMarks - 4) marks[4 + issued] = clock_now() - waited;
          ++issued;
        }
      };
      const int item_chunks = fc1_chunks + fc2_chunks;
      if (p.tiles) {
        const int fc1_tiles = p.units * kFc1Tiles, total = fc1_tiles + p.units * kFc2Tiles;
        for (int t = blockIdx.x; t < total; t += gridDim.x) {
          const bool fc1 = t < fc1_tiles;
          const int i = fc1 ? t : t - fc1_tiles, per = fc1 ? kFc1Tiles : kFc2Tiles, u = i / per, k = i % per;
          const uint8_t *expert = p.w + (size_t)p.ids[u] * kExpertBytes;
          if (fc1)
            stream(expert + (size_t)k * kFc1TileChunks * kTileChunk, kFc1TileChunks, kTileChunk);
          else
            stream(expert + (size_t)(kFc1Tiles * kFc1TileChunks + k * kFc2TileChunks) * kTileChunk, kFc2TileChunks,
                   kTileChunk);
        }
      } else if (!p.dynamic) {
        for (int i = cluster_index(); i < items; i += clusters) {
          const int u = i % p.units, s = i / p.units;
          stream(p.w + ((size_t)(p.ids[u] * p.slices + s) * p.ways + rank) * item_bytes, item_chunks, kChunk);
        }
      } else {
        /* the next claim goes out before this half-item's copies: its round trip overlaps them */
        for (int h = (int)atomicAdd(p.claims, 1u); h < items * p.ways;) {
          const int next = (int)atomicAdd(p.claims, 1u);
          const int u = h % p.units, rest = h / p.units; /* rest: slice * ways + share */
          stream(p.w + ((size_t)p.ids[u] * p.slices * p.ways + rest) * item_bytes, item_chunks, kChunk);
          h = next;
        }
      }
      if (p.dynamic || p.tiles) { /* the consumers go on until this stage */
        kx::mbar_wait(&sh.empty[pos.stage], pos.parity ^ 1u);
        sh.last[pos.stage] = true;
        kx::mbar_arrive(&sh.full[pos.stage]);
      }
      for (int k = 0; k < kStartMarks; ++k) p.starts[blockIdx.x * kStartMarks + k] = marks[k];
    }
  } else if (warp <= kConsumerWarps) {
    const int t = threadIdx.x - 32;
    kx::RingPos pos;
    int mine = 0;
    bool first = true;
    long long turn[4] = {};
    const auto consume = [&](int chunks, int cycles) {
      for (int c = 0; c < chunks; ++c, pos.advance(p.stages)) {
        const long long t0 = clock_now();
        kx::mbar_wait(&sh.full[pos.stage], pos.parity);
        if ((p.dynamic || p.tiles) && sh.last[pos.stage]) break;
        const long long t1 = clock_now();
        if (first && t == 0) stamp[1] = kx::global_ns();
        first = false;
        if (!p.release_first) spin(cycles);
        const long long t2 = clock_now();
        __syncwarp();
        if (lane == 0) kx::mbar_arrive(&sh.empty[pos.stage]);
        if (p.release_first) spin(cycles);
        const long long t3 = clock_now();
        turn[0] += t1 - t0;
        turn[1] += t2 - t1;
        turn[2] += t3 - t2;
        ++turn[3];
      }
    };
    const bool open_ended = p.dynamic || p.tiles;
    if (open_ended) consume(INT_MAX, p.fc1_spin); /* until the stage marked last */
    for (int i = cluster_index(); i < items && !open_ended; i += clusters, ++mine) {
      const int s = i / p.units, buf = mine & 1;
      consume(fc1_chunks, p.fc1_spin);
      /* the swap: each CTA's 64 FC1 partial sums to every other CTA of the cluster, on the buffer
       * and barrier of the item's parity. Both are used again two items later, once every
       * partner has passed the item between, so each reader is done with them and no arrival
       * for item i + 2 can land in item i's phase. */
      if (p.swap && t < kSumRows) {
        const float partial = (float)(rank + 1);
        sh.swap[buf][rank][t] = partial;
        for (uint32_t r = 0; r < (uint32_t)p.ways; ++r) {
          if (r == rank) continue;
          asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(remote(&sh.swap[buf][rank][t], r)), "f"(partial)
                       : "memory");
          asm volatile("mbarrier.arrive.release.cluster.shared::cluster.b64 _, [%0];" ::"r"(remote(&sh.swapped[buf], r))
                       : "memory");
        }
      }
      if (p.swap) swap_wait(&sh.swapped[buf], (uint32_t)(mine >> 1) & 1u);
      spin(p.swap_spin);
      consume(fc2_chunks, p.fc2_spin);
      if (!p.sums) continue;
      if (mine >= 2) kx::named_barrier(kBarFree + buf, kConsumers + 32);
      for (int r = t; r < part_rows; r += kConsumers) sh.parked[buf][r] = (float)(s + 1);
      kx::named_barrier_arrive(kBarParked + buf, kConsumers + 32);
    }
    if (t == 0)
      for (int k = 0; k < 4; ++k) p.turns[blockIdx.x * 4 + k] = turn[k];
    if (!p.sums) {
      kx::named_barrier(kBarConsumers, kConsumers);
      if (t == 0) stamp[2] = kx::global_ns();
    } else {
      kx::named_barrier(kBarEnd, kConsumers + 32); /* the epilogue's targets are in */
      /* The sum over slices: each item's CTA adds a 1/slices share of the rows, in slice order. All
       * its items' counts are polled at once and all their loads issued together: one round trip
       * each, not one per item. */
      if (t < mine) {
        const int u = (cluster_index() + t * clusters) % p.units;
        kx::wait_count(&p.done[u * p.ways + rank], sh.targets[t]);
      }
      kx::named_barrier(kBarConsumers, kConsumers);
      const int share = (part_rows + p.slices - 1) / p.slices;
      for (int base = 0; base < mine * share; base += 4 * kConsumers) {
        float v[4][kMaxSlices];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int f = base + j * kConsumers + t, item = cluster_index() + f / share * clusters;
          const int u = item % p.units, r = item / p.units * share + f % share;
          const bool live = f < mine * share && r < part_rows;
          const float *slice0 = p.partials + ((size_t)u * p.slices * p.ways + rank) * part_rows + r;
#pragma unroll
          for (int k = 0; k < kMaxSlices; ++k)
            v[j][k] = live && k < p.slices ? __ldcg(slice0 + (size_t)k * p.ways * part_rows) : 0.f;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int f = base + j * kConsumers + t, item = cluster_index() + f / share * clusters;
          const int u = item % p.units, r = item / p.units * share + f % share;
          if (f >= mine * share || r >= part_rows) continue;
          float sum = 0.f;
#pragma unroll
          for (int k = 0; k < kMaxSlices; ++k) sum += k < p.slices ? v[j][k] : 0.f;
          p.out[(size_t)u * p.H + rank * part_rows + r] = __float2bfloat16(sum);
        }
      }
    }
  } else if (p.sums) {
    /* the epilogue warp: each parked partial row to global memory, then the count */
    int mine = 0;
    const int count = (items - (int)cluster_index() + clusters - 1) / clusters;
    for (int i = cluster_index(); i < items; i += clusters, ++mine) {
      const int u = i % p.units, s = i / p.units, buf = mine & 1;
      kx::named_barrier(kBarParked + buf, kConsumers + 32);
      float *rows = p.partials + ((size_t)(u * p.slices + s) * p.ways + rank) * part_rows;
      for (int r = lane * 4; r < part_rows; r += 128)
        *reinterpret_cast<float4 *>(rows + r) = *reinterpret_cast<const float4 *>(&sh.parked[buf][r]);
      __threadfence();
      __syncwarp();
      if (lane == 0) {
        const unsigned old = atomicAdd(&p.done[u * p.ways + rank], 1u);
        sh.targets[mine] = (old / p.slices + 1) * p.slices; /* this launch's count with every slice in */
      }
      __syncwarp();
      if (mine + 2 < count) kx::named_barrier_arrive(kBarFree + buf, kConsumers + 32);
    }
    if (lane == 0) stamp[2] = kx::global_ns();
    kx::named_barrier_arrive(kBarEnd, kConsumers + 32);
  }
  __syncthreads();
  kx::cluster_sync(); /* no CTA leaves while a partner may still write its swap buffer */
  if (threadIdx.x == 0) stamp[3] = kx::global_ns();
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    p.clocks[0] = clock_now() - clock_at_wait;
    p.clocks[1] = (long long)(stamp[3] - stamp[0]);
  }
}

struct Case {
  const char *name;
  Shape shape;
  int units, ways;
  int start_spin, fc1_spin, fc2_spin, swap_spin;
  bool swap, sums, touch; /* touch: the weights written once before (pages touched) */
  int stages = 4;
  bool dynamic = false, pdl = true, release_first = false, hint = true, skip_first_waits = false, tiles = false;
};

/* One layer's buffers: its weights (every expert) and its ids. */
struct Layer {
  Dev w, ids;
  Layer(size_t weight_bytes, int units) : w(weight_bytes), ids(units * sizeof(int)) {}
};

void run_case(const Case &k, int sms, double hbm_TBps, cudaStream_t stream) {
  const int slices = k.shape.I / 32, part_rows = k.shape.H / k.ways;
  const size_t item_bytes = (size_t)3 * (part_rows / 896) * kChunk;
  const size_t layer_bytes = std::max((size_t)k.shape.E * slices * k.ways * item_bytes, k.shape.E * kExpertBytes);
  const int min_clusters = sms / k.ways / 2; /* fewer co-resident clusters would not be worth a row */
  if (part_rows % 896 || part_rows > kMaxPartRows || slices > kMaxSlices || k.ways > kMaxWays || k.ways < 2 ||
      k.stages > kMaxStages || (k.sums && k.units * slices > kMaxItems * min_clusters) ||
      (k.tiles && (k.shape.H != 3584 || k.shape.I != 384 || k.swap || k.sums || k.dynamic))) {
    fprintf(stderr, "%s: outside the probe's limits\n", k.name);
    exit(2);
  }
  cudaLaunchConfig_t probe_cfg = {};
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = k.ways;
  attr[0].val.clusterDim.y = attr[0].val.clusterDim.z = 1;
  attr[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[1].val.programmaticStreamSerializationAllowed = 1;
  probe_cfg.gridDim = dim3(sms / k.ways * k.ways);
  probe_cfg.blockDim = dim3(kThreads);
  probe_cfg.dynamicSmemBytes = kSmemBytes;
  probe_cfg.stream = stream;
  probe_cfg.attrs = attr;
  probe_cfg.numAttrs = 1;
  int clusters = 0;
  CHECK(cudaOccupancyMaxActiveClusters(&clusters, slice_fused, &probe_cfg));
  const int grid = std::min(sms / k.ways, clusters) * k.ways;
  if (grid / k.ways < min_clusters) {
    fprintf(stderr, "%s: only %d clusters of %d fit\n", k.name, clusters, k.ways);
    exit(2);
  }
  std::vector<Layer *> layers;
  std::mt19937 rng(1234);
  for (int l = 0; l < kLayers; ++l) {
    layers.push_back(new Layer(layer_bytes, k.units));
    if (k.touch) CHECK(cudaMemset(layers[l]->w.p, 0x3c, layer_bytes));
    std::vector<int> experts(k.shape.E);
    for (int e = 0; e < k.shape.E; ++e) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), rng);
    CHECK(cudaMemcpy(layers[l]->ids.p, experts.data(), k.units * sizeof(int), cudaMemcpyHostToDevice));
  }
  const size_t partial_floats = (size_t)k.units * slices * k.ways * part_rows;
  Dev partials(partial_floats * sizeof(float)), out((size_t)k.units * k.shape.H * 2),
      done((size_t)kLayers * k.units * k.ways * sizeof(unsigned)), claims(kLayers * sizeof(unsigned)),
      stamps((size_t)kLayers * grid * 4 * sizeof(unsigned long long)),
      starts((size_t)kLayers * grid * kStartMarks * sizeof(long long)), clocks(kLayers * 2 * sizeof(long long)),
      turns((size_t)kLayers * grid * 4 * sizeof(long long));
  CHECK(cudaMemset(done.p, 0, (size_t)kLayers * k.units * k.ways * sizeof(unsigned)));
  CHECK(cudaMemset(claims.p, 0, kLayers * sizeof(unsigned)));
  CHECK(cudaMemset(partials.p, 0xff, partial_floats * sizeof(float))); /* NaN: a sum read early shows */
  CHECK(cudaMemset(out.p, 0xff, (size_t)k.units * k.shape.H * 2));
  const auto body = [&] {
    for (int l = 0; l < kLayers; ++l) {
      Params p = {layers[l]->w.as<uint8_t>(), layers[l]->ids.as<int>(), partials.as<float>(),
                  out.as<__nv_bfloat16>(), done.as<unsigned>() + (size_t)l * k.units * k.ways,
                  stamps.as<unsigned long long>() + (size_t)l * grid * 4,
                  starts.as<long long>() + (size_t)l * grid * kStartMarks, k.units, slices, k.ways, k.shape.H,
                  k.start_spin, k.fc1_spin, k.fc2_spin, k.swap_spin, k.swap, k.sums,
                  k.stages, k.release_first, k.dynamic, claims.as<unsigned>() + l,
                  claims.as<unsigned>() + (l + kLayers - 1) % kLayers, k.hint, k.skip_first_waits, k.tiles,
                  clocks.as<long long>() + 2 * l, turns.as<long long>() + (size_t)l * grid * 4};
      cudaLaunchConfig_t cfg = probe_cfg;
      cfg.gridDim = dim3(grid);
      cfg.numAttrs = k.pdl ? 2 : 1;
      CHECK(cudaLaunchKernelEx(&cfg, slice_fused, p));
    }
  };
  body(); /* one pass outside a graph: every output must be the sum of slices 1..S */
  CHECK(cudaStreamSynchronize(stream));
  std::vector<__nv_bfloat16> h_out((size_t)k.units * k.shape.H);
  CHECK(cudaMemcpy(h_out.data(), out.p, h_out.size() * 2, cudaMemcpyDeviceToHost));
  const float want = slices * (slices + 1) / 2.f;
  size_t wrong = 0;
  for (const __nv_bfloat16 v : h_out) wrong += __bfloat162float(v) != want;
  char checked[48] = "- (no sums)";
  if (k.sums) snprintf(checked, sizeof checked, "%zu of %zu", wrong, h_out.size());
  const float us = graph_us(stream, body) / kLayers;
  std::vector<unsigned long long> h((size_t)kLayers * grid * 4);
  CHECK(cudaMemcpy(h.data(), stamps.p, h.size() * sizeof(h[0]), cudaMemcpyDeviceToHost));
  std::vector<double> full, items_mid, items_done, exit_last;
  for (int l = 1; l < kLayers; ++l) {
    const unsigned long long *s = &h[(size_t)l * grid * 4];
    unsigned long long t0 = ~0ull, last = 0;
    std::vector<double> f, d;
    for (int c = 0; c < grid; ++c) t0 = std::min(t0, s[c * 4]);
    for (int c = 0; c < grid; ++c) {
      f.push_back((s[c * 4 + 1] - t0) / 1000.0);
      d.push_back((s[c * 4 + 2] - t0) / 1000.0);
      last = std::max(last, s[c * 4 + 3]);
    }
    full.push_back(median(f));
    items_mid.push_back(median(d));
    items_done.push_back(percentile(d, 1.0));
    exit_last.push_back((last - t0) / 1000.0);
  }
  const double floor_us = (double)k.units * slices * k.ways * item_bytes / (hbm_TBps * 1e12) * 1e6;
  printf("%-40s grid %3d | %7.2f us a layer, floor %5.2f, ratio %.2f | after the first wait: first stage full %.2f, "
         "items done (median / last CTA) %.2f / %.2f, last exit %.2f us | outputs wrong %s\n",
         k.name, grid, us, floor_us, us / floor_us, median(full), median(items_mid), median(items_done), median(exit_last), checked);
  std::vector<long long> hs((size_t)kLayers * grid * kStartMarks);
  CHECK(cudaMemcpy(hs.data(), starts.p, hs.size() * sizeof(hs[0]), cudaMemcpyDeviceToHost));
  double mark[kStartMarks];
  for (int m = 0; m < kStartMarks; ++m) {
    std::vector<double> per_layer;
    for (int l = 1; l < kLayers; ++l) {
      std::vector<double> v;
      for (int c = 0; c < grid; ++c) v.push_back(hs[((size_t)l * grid + c) * kStartMarks + m] / 1000.0);
      per_layer.push_back(median(v));
    }
    mark[m] = median(per_layer);
  }
  std::vector<long long> hc(kLayers * 2);
  CHECK(cudaMemcpy(hc.data(), clocks.p, hc.size() * sizeof(hc[0]), cudaMemcpyDeviceToHost));
  std::vector<double> ghz;
  for (int l = 1; l < kLayers; ++l) ghz.push_back((double)hc[2 * l] / (double)hc[2 * l + 1]);
  std::vector<long long> ht((size_t)kLayers * grid * 4);
  CHECK(cudaMemcpy(ht.data(), turns.p, ht.size() * sizeof(ht[0]), cudaMemcpyDeviceToHost));
  double turn[3];
  for (int m = 0; m < 3; ++m) {
    std::vector<double> v;
    for (int l = 1; l < kLayers; ++l)
      for (int c = 0; c < grid; ++c) {
        const long long *x = &ht[((size_t)l * grid + c) * 4];
        if (x[3] > 0) v.push_back((double)x[m] / x[3]);
      }
    turn[m] = median(v);
  }
  printf("    the producer after its wait (kcycles, medians): an id loaded %.2f, policy %.2f, the first copy's empty "
         "wait %.2f, expect_tx %.2f, copies issued %.2f %.2f %.2f %.2f; SM clock %.2f GHz\n",
         mark[0], mark[1], mark[2], mark[3], mark[4], mark[5], mark[6], mark[7], median(ghz));
  printf("    consumer warp 0 per chunk (cycles, median CTA): full wait %.0f, spin %.0f, syncwarp + arrive %.0f\n", turn[0],
         turn[1], turn[2]);
  for (Layer *l : layers) delete l;
}

}  // namespace

int main() {
  static_assert(sizeof(Shared) <= kSmemBytes, "the stages fit");
  CHECK(cudaFuncSetAttribute(slice_fused, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  CHECK(cudaFuncSetAttribute(slice_fused, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const StreamProbe probe;
  const int sms = probe.sms;
  const cudaStream_t stream = probe.s;
  const double hbm = probe.floor_TBps;
  printf("%d SMs, HBM read %.2f TB/s, %d layers a graph; spins in cycles (start / per FC1 chunk / per FC2 chunk / "
         "after the swap); the experts kernel on v71: k3-tp8 B = 1 14.21 us, B = 2 25.97, TP16 B = 1 12.00\n",
         sms, hbm, kLayers);
  const Shape k3{3584, 384, 384}, tp16{3584, 192, 384};
  /* the MMA warps' pace at B = 1: ~0.81 kcycle per 17 KB chunk (session 30), ~0.72 per 15 KB here */
  /* name, shape, units, ways, spins (start, FC1 chunk, FC2 chunk, swap), swap, sums, touch */
  const Case cases[] = {
      {"k3-tp8 B=1 stream", k3, 16, 2, 0, 0, 0, 0, false, false, true},
      {"k3-tp8 B=1 stream, 6 stages", k3, 16, 2, 0, 0, 0, 0, false, false, true, 6},
      {"k3-tp8 B=1 stream, 8 stages", k3, 16, 2, 0, 0, 0, 0, false, false, true, 8},
      {"k3-tp8 B=1 stream, claimed", k3, 16, 2, 0, 0, 0, 0, false, false, true, 4, true},
      {"k3-tp8 B=1 stream, no L2 hint", k3, 16, 2, 0, 0, 0, 0, false, false, true, 4, false, true, false, false},
      {"k3-tp8 B=1 stream, first lap unwaited", k3, 16, 2, 0, 0, 0, 0, false, false, true, 4, false, true, false, true, true},
      {"k3-tp8 B=1 stream, no PDL", k3, 16, 2, 0, 0, 0, 0, false, false, true, 4, false, false},
      {"k3-tp8 B=1 stream, start 2000", k3, 16, 2, 2000, 0, 0, 0, false, false, true},
      {"k3-tp8 B=1 stream, 360 a chunk", k3, 16, 2, 0, 360, 360, 0, false, false, true},
      {"k3-tp8 B=1 stream, 540 a chunk", k3, 16, 2, 0, 540, 540, 0, false, false, true},
      {"k3-tp8 B=1 stream, 720 a chunk", k3, 16, 2, 0, 720, 720, 0, false, false, true},
      {"k3-tp8 B=1 stream, 720 a chunk, 8 stages", k3, 16, 2, 0, 720, 720, 0, false, false, true, 8},
      {"k3-tp8 B=1 stream, 720 after freeing", k3, 16, 2, 0, 720, 720, 0, false, false, true, 4, false, true, true},
      {"k3-tp8 B=1 stream, 900 after freeing", k3, 16, 2, 0, 900, 900, 0, false, false, true, 4, false, true, true},
      {"k3-tp8 B=1 stream, 2000 + 720 after freeing", k3, 16, 2, 2000, 720, 720, 0, false, false, true, 4, false, true, true},
      {"k3-tp8 B=1 stream, 2000 + 360 a chunk", k3, 16, 2, 2000, 360, 360, 0, false, false, true},
      {"k3-tp8 B=1 stream, 1000 + 360 a chunk", k3, 16, 2, 1000, 360, 360, 0, false, false, true},
      {"k3-tp8 B=1 stream, 2000 + 720 a chunk", k3, 16, 2, 2000, 720, 720, 0, false, false, true},
      {"k3-tp8 B=1 stream, 2000 + 720, first lap unwaited", k3, 16, 2, 2000, 720, 720, 0, false, false, true, 4, false, true, false, true, true},
      {"k3-tp8 B=1 stream, 2000 + 720, 8 stages", k3, 16, 2, 2000, 720, 720, 0, false, false, true, 8},
      {"k3-tp8 B=1 stream, 2000 + 900, 8 stages", k3, 16, 2, 2000, 900, 900, 0, false, false, true, 8},
      {"k3-tp8 B=1 stream + swap", k3, 16, 2, 0, 0, 0, 0, true, false, true},
      {"k3-tp8 B=1 stream + swap + sums", k3, 16, 2, 0, 0, 0, 0, true, true, true},
      {"k3-tp8 B=1 all, 2000/720/720/600", k3, 16, 2, 2000, 720, 720, 600, true, true, true},
      {"k3-tp8 B=2 stream", k3, 32, 2, 0, 0, 0, 0, false, false, true},
      {"k3-tp8 B=2 stream, claimed", k3, 32, 2, 0, 0, 0, 0, false, false, true, 4, true},
      {"k3-tp8 B=2 all, 2000/720/720/600", k3, 32, 2, 2000, 720, 720, 600, true, true, true},
      {"tp16 B=1 all, 2000/720/720/600", tp16, 16, 2, 2000, 720, 720, 600, true, true, true},
      /* B = 64's 352 experts (the same stream at 22x the bytes): what a per-chunk pace costs there */
      {"k3-tp8 B=8's bytes, stream", k3, 109, 2, 0, 0, 0, 0, false, false, true},
      {"k3-tp8 B=8's bytes, 720 a chunk", k3, 109, 2, 0, 720, 720, 0, false, false, true},
      {"k3-tp8 B=64's bytes, stream", k3, 352, 2, 0, 0, 0, 0, false, false, true},
      {"k3-tp8 B=64's bytes, 360 a chunk", k3, 352, 2, 0, 360, 360, 0, false, false, true},
      {"k3-tp8 B=64's bytes, 540 a chunk", k3, 352, 2, 0, 540, 540, 0, false, false, true},
      {"k3-tp8 B=64's bytes, 720 a chunk", k3, 352, 2, 0, 720, 720, 0, false, false, true},
      {"k3-tp8 B=64's bytes, 720 a chunk, 6 stages", k3, 352, 2, 0, 720, 720, 0, false, false, true, 6},
      {"k3-tp8 B=64's bytes, claimed", k3, 352, 2, 0, 0, 0, 0, false, false, true, 4, true},
      {"k3-tp8 B=64's bytes, 720 a chunk, claimed", k3, 352, 2, 0, 720, 720, 0, false, false, true, 4, true},
      /* the experts kernel's tiles and deal (17 KB chunks: 612 / 816 cycles are 540 / 720 per 15 KB) */
      {"kernel tiles, B=1's experts", k3, 16, 2, 0, 0, 0, 0, false, false, true, 4, false, true, false, true, false, true},
      {"kernel tiles, B=1's, 2000 + 816", k3, 16, 2, 2000, 816, 816, 0, false, false, true, 4, false, true, false, true, false, true},
      {"kernel tiles, B=8's experts", k3, 109, 2, 0, 0, 0, 0, false, false, true, 4, false, true, false, true, false, true},
      {"kernel tiles, B=8's, 612 a chunk", k3, 109, 2, 0, 612, 612, 0, false, false, true, 4, false, true, false, true, false, true},
      {"kernel tiles, B=8's, 816 a chunk", k3, 109, 2, 0, 816, 816, 0, false, false, true, 4, false, true, false, true, false, true},
      {"kernel tiles, B=64's experts", k3, 352, 2, 0, 0, 0, 0, false, false, true, 4, false, true, false, true, false, true},
      {"kernel tiles, B=64's, 612 a chunk", k3, 352, 2, 0, 612, 612, 0, false, false, true, 4, false, true, false, true, false, true},
      {"kernel tiles, B=64's, 714 a chunk", k3, 352, 2, 0, 714, 714, 0, false, false, true, 4, false, true, false, true, false, true},
      {"kernel tiles, B=64's, 816 a chunk", k3, 352, 2, 0, 816, 816, 0, false, false, true, 4, false, true, false, true, false, true},
  };
  for (const Case &k : cases) run_case(k, sms, hbm, stream);
  return 0;
}
