/* harness.cuh: what the stand-alone GPU harnesses in benchmarks/ share (ws_gemm_check.cu,
 * experts_marks.cu, the probes): a CUDA call checked or the program ends, a device buffer,
 * CUDA-graph timing, a chained launch's configuration and the HBM read floor. Host code only; each harness is its own program. */
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <algorithm>
#include <vector>

#include "kimi_kernels.h"

#define CHECK(call)                                                                         \
  do {                                                                                      \
    cudaError_t e_ = (call);                                                                \
    if (e_ != cudaSuccess) {                                                                \
      fprintf(stderr, "%s:%d: %s -> %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      exit(2);                                                                              \
    }                                                                                       \
  } while (0)

/* Device bytes from cudaMalloc, freed with the object. */
struct Dev {
  void *p = nullptr;
  explicit Dev(size_t bytes) { CHECK(cudaMalloc(&p, bytes)); }
  ~Dev() { cudaFree(p); }
  template <class T> T *as() const { return (T *)p; }
};

/* v's q-quantile (q in [0, 1], 1 the largest) by sorting a copy: the element at q * size. */
template <class T>
static T percentile(std::vector<T> v, double q) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, (size_t)(q * v.size()))];
}

template <class T>
static T median(const std::vector<T> &v) {
  return percentile(v, 0.5);
}

/* `body` (which enqueues work on s) captured into an executable graph. */
template <class F>
static cudaGraphExec_t capture_graph(cudaStream_t s, F body) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  body();
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  CHECK(cudaGraphDestroy(g)); /* the executable graph does not need it */
  return ge;
}

/* Captures `body` into a graph; the median of `replays` replays, in us. */
template <class F>
static float graph_us(cudaStream_t s, F body, int replays = 60) {
  const cudaGraphExec_t ge = capture_graph(s, body);
  for (int i = 0; i < 5; ++i) CHECK(cudaGraphLaunch(ge, s));
  std::vector<cudaEvent_t> ev(replays + 1);
  for (auto &e : ev) CHECK(cudaEventCreate(&e));
  CHECK(cudaEventRecord(ev[0], s));
  for (int i = 0; i < replays; ++i) {
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(ev[i + 1], s));
  }
  CHECK(cudaStreamSynchronize(s));
  std::vector<float> t(replays);
  for (int i = 0; i < replays; ++i) CHECK(cudaEventElapsedTime(&t[i], ev[i], ev[i + 1]));
  for (auto &e : ev) CHECK(cudaEventDestroy(e));
  CHECK(cudaGraphExecDestroy(ge));
  return median(t) * 1000.f;
}

/* A launch for cudaLaunchKernelEx(&l.cfg, kernel, args...): programmatic dependent launch on or
 * off, clusters of `cluster` CTAs when more than one. Built in place: cfg points at attr. */
struct ChainedLaunch {
  cudaLaunchAttribute attr[2];
  cudaLaunchConfig_t cfg = {};
  ChainedLaunch(bool pdl, unsigned grid, unsigned threads, size_t smem, int cluster, cudaStream_t s) {
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = pdl ? 1 : 0;
    attr[1].id = cudaLaunchAttributeClusterDimension;
    attr[1].val.clusterDim.x = (unsigned)cluster;
    attr[1].val.clusterDim.y = attr[1].val.clusterDim.z = 1;
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(threads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cfg.attrs = attr;
    cfg.numAttrs = cluster > 1 ? 2 : 1;
  }
  ChainedLaunch(const ChainedLaunch &) = delete;
};

static double hbm_read_TBps(cudaStream_t s) {
  const size_t bytes = (size_t)4 << 30;
  Dev buf(bytes), sink(64);
  CHECK(cudaMemset(buf.p, 1, bytes));
  const float us = graph_us(s, [&] { CHECK(kx_probe_read(buf.p, (int64_t)bytes, sink.as<uint32_t>(), s)); }, 20);
  return (double)bytes / (us * 1e-6) / 1e12;
}

/* What a stream probe starts from: the SM count, a non-blocking stream and the HBM read floor. */
struct StreamProbe {
  int sms = 0;
  cudaStream_t s = nullptr;
  double floor_TBps = 0.0;
  StreamProbe() {
    CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    floor_TBps = hbm_read_TBps(s);
  }
};
