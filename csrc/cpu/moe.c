/* moe.c: one MoE layer's routed experts on the CPU (SPEC 3).
 *
 * For token t and slot j with expert e = ids[t, j]:
 *   xq = MXFP8(x[t]) (rceil)                      a = W13[e] . xq        [2I]
 *   h[i] = silu(cap(a[i], beta)) * cap(a[I + i], linear_beta),  cap(v, c) = c tanh(v / c)
 *   hq = MXFP8(h) (hidden_scale)                  y = bf16(W2[e] . hq)   [H]
 * out[t * K + j] = y, or, when combining, z[t] = bf16(sum_j w[t, j] * y_tj) in slot order.
 *
 * Shape of the work: a decode step routes few tokens to each expert, so the cost is
 * decoding FP4 weights, not multiplying. The (token, expert) pairs are grouped by
 * expert ("tasks"), and each weight row is decoded once to fp32 and dotted with every
 * task of its expert. Work units are (expert, block of rows) so even one token's 16
 * experts spread over the cores. Decoded weights and MXFP8 activations are exact in
 * fp32, so only the fp32 accumulation rounds; every output element is summed by one
 * unit in a fixed order, so results do not depend on the thread count or schedule.
 *
 * Phases (one parallel region, a barrier after each): quantize tokens, FC1, SiTU +
 * MXFP8, FC2, write rows (or combine). A bad id gets no task: its row is NaN, and so
 * is the combined row of its token.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_backend.h"
#include "cpu_parallel.h"
#include "mx_internal.h"

/* Weight bytes per work unit: enough to amortize scheduling, few enough that one
 * k3-tp8 expert (1.4 MB of W13, 0.7 MB of W2) splits into a dozen or more units. */
#define UNIT_WEIGHT_BYTES (64 * 1024)
#define WORKSPACE_ALIGN 64 /* cache line */
#define NO_TASK (-1)

_Static_assert(KX_MX_BLOCK % KX_DOT_LANES == 0, "rows of whole MX blocks must fill the dot lanes");

/* ---- workspace: carved from one allocation per call ---- */

typedef struct moe_work {
  /* The plan: distinct (token, expert) pairs ("tasks") grouped by expert. */
  int32_t *ids;          /* [B * K] the caller's ids, copied once: planning reads each twice or
                            more, and a caller writing them meanwhile must not make it inconsistent */
  int64_t *slot_task;    /* [B * K] task of each slot, NO_TASK for a bad id */
  int64_t *task_token;   /* [B * K] token of each task; tokens ascend within an expert */
  int64_t *expert_first; /* [E + 1] expert e owns tasks expert_first[e] .. [e + 1] - 1 */
  int64_t *cursor;       /* [E] fill position per expert while planning */
  int32_t *active;       /* [E] experts with at least one task, ascending */
  int32_t active_count;
  /* Activations (fp32, exact where they are MX values). */
  float *x;    /* [B, H] dequantized MXFP8(x) */
  float *a;    /* [B * K, 2I] FC1 outputs */
  float *h;    /* [B * K, I] dequantized MXFP8(SiTU(a)) */
  float *y;    /* [B * K, H] FC2 outputs before bf16 rounding */
  float *rows;     /* [threads, row_cap] a decoded weight row or a combine row per thread */
  int64_t row_cap; /* max(H, I): FC1 rows are H long, FC2 rows I long */
} moe_work;

typedef struct arena {
  unsigned char *base; /* NULL while measuring */
  size_t used;
  int overflow;
} arena;

static void *arena_take(arena *ar, int64_t count, size_t elem) {
  const size_t start = (ar->used + WORKSPACE_ALIGN - 1) & ~(size_t)(WORKSPACE_ALIGN - 1);
  if (count < 0 || (uint64_t)count > (SIZE_MAX - start) / elem) {
    ar->overflow = 1;
    return NULL;
  }
  ar->used = start + (size_t)count * elem;
  return ar->base ? ar->base + start : NULL;
}

/* Run twice: once with base == NULL to measure, once to hand out the pointers. Tasks
 * are sized for the worst case, every slot a distinct pair, which is also the usual one. */
static void carve_work(arena *ar, const kx_cpu_moe_layer *layer, int64_t batch, int threads,
                       moe_work *w) {
  const int64_t slots = batch * layer->top_k, hidden = layer->hidden, inter = layer->inter;
  w->ids = arena_take(ar, slots, sizeof(int32_t));
  w->slot_task = arena_take(ar, slots, sizeof(int64_t));
  w->task_token = arena_take(ar, slots, sizeof(int64_t));
  w->expert_first = arena_take(ar, (int64_t)layer->experts + 1, sizeof(int64_t));
  w->cursor = arena_take(ar, layer->experts, sizeof(int64_t));
  w->active = arena_take(ar, layer->experts, sizeof(int32_t));
  w->x = arena_take(ar, batch * hidden, sizeof(float));
  w->a = arena_take(ar, slots * 2 * inter, sizeof(float));
  w->h = arena_take(ar, slots * inter, sizeof(float));
  w->y = arena_take(ar, slots * hidden, sizeof(float));
  w->row_cap = hidden > inter ? hidden : inter;
  w->rows = arena_take(ar, (int64_t)threads * w->row_cap, sizeof(float));
}

/* ---- planning ---- */

/* The first slot of this token that names the same expert as slot j (j itself if none):
 * repeated experts share one task. */
static int32_t first_slot_of(const int32_t *token_ids, int32_t j) {
  int32_t i = 0;
  while (token_ids[i] != token_ids[j]) ++i;
  return i;
}

static int valid_id(int32_t id, int32_t experts) { return id >= 0 && id < experts; }

/* Planning pass 1: copies the ids, counts each expert's tasks into expert_first[e + 1] and
 * reports the first bad id in row-major order. */
static kx_cpu_fault count_tasks(const kx_cpu_moe_layer *layer, const kx_cpu_moe_call *call,
                                moe_work *w) {
  const int32_t k = layer->top_k, experts = layer->experts;
  kx_cpu_fault fault = {0, 0, 0, 0};
  memset(w->expert_first, 0, ((size_t)experts + 1) * sizeof(int64_t));
  for (int64_t t = 0; t < call->batch; ++t)
    memcpy(w->ids + t * k, call->ids + t * call->ids_row_stride, (size_t)k * sizeof(int32_t));
  for (int64_t t = 0; t < call->batch; ++t) {
    const int32_t *ids = w->ids + t * k;
    for (int32_t j = 0; j < k; ++j) {
      if (!valid_id(ids[j], experts)) {
        if (!fault.bad) fault = (kx_cpu_fault){1, t, j, ids[j]};
      } else if (first_slot_of(ids, j) == j) {
        w->expert_first[ids[j] + 1] += 1;
      }
    }
  }
  return fault;
}

/* Planning pass 2 (a counting sort): prefix sums give each expert its range of tasks,
 * then tasks are placed in token order, so tokens ascend within an expert. */
static void place_tasks(const kx_cpu_moe_layer *layer, const kx_cpu_moe_call *call,
                        moe_work *w) {
  const int32_t k = layer->top_k, experts = layer->experts;
  w->active_count = 0;
  for (int32_t e = 0; e < experts; ++e) {
    if (w->expert_first[e + 1] > 0) w->active[w->active_count++] = e;
    w->expert_first[e + 1] += w->expert_first[e];
    w->cursor[e] = w->expert_first[e];
  }
  for (int64_t t = 0; t < call->batch; ++t) {
    const int32_t *ids = w->ids + t * k;
    int64_t *slot_task = w->slot_task + t * k;
    for (int32_t j = 0; j < k; ++j) {
      if (!valid_id(ids[j], experts)) {
        slot_task[j] = NO_TASK;
        continue;
      }
      const int32_t first = first_slot_of(ids, j);
      if (first < j) {
        slot_task[j] = slot_task[first];
        continue;
      }
      const int64_t task = w->cursor[ids[j]]++;
      w->task_token[task] = t;
      slot_task[j] = task;
    }
  }
}

/* ---- phases (each an orphaned `omp for`: it splits over the enclosing team) ---- */

static void quantize_tokens(const kx_cpu_moe_layer *layer, const kx_cpu_moe_call *call,
                            moe_work *w) {
  const int64_t hidden = layer->hidden;
  KX_OMP(for schedule(static))
  for (int64_t t = 0; t < call->batch; ++t) {
    const uint16_t *src = call->x + t * call->x_row_stride;
    float *dst = w->x + t * hidden;
    for (int64_t k = 0; k < hidden; ++k) dst[k] = kx_bf16_widen(src[k]);
    kx_mxfp8_roundtrip_row(dst, hidden, KX_SCALE_RCEIL, dst);
  }
}

/* One projection of every active expert: out[task, r] = W[e, r, :] . in[input row of
 * task], with W in MXFP4 [E, rows, cols]. The input row of a task is its token (FC1)
 * or the task itself (FC2, task_token == NULL). */
typedef struct expert_matmul {
  const uint8_t *w, *s;
  int64_t rows, cols;
  const float *in;
  const int64_t *task_token;
  float *out;
} expert_matmul;

static void run_expert_matmul(const expert_matmul *mm, const moe_work *w,
                              const kx_e2m1_pair_lut *lut, float *wrow) {
  const int64_t row_bytes = mm->cols / 2 + mm->cols / KX_MX_BLOCK;
  const int64_t unit_rows = row_bytes < UNIT_WEIGHT_BYTES ? UNIT_WEIGHT_BYTES / row_bytes : 1;
  const int64_t units_per_expert = (mm->rows + unit_rows - 1) / unit_rows;
  /* Dynamic: experts carry different task counts; which thread runs a unit cannot
   * change its results. */
  KX_OMP(for schedule(dynamic))
  for (int64_t u = 0; u < w->active_count * units_per_expert; ++u) {
    const int64_t e = w->active[u / units_per_expert];
    const int64_t r0 = (u % units_per_expert) * unit_rows;
    const int64_t r1 = r0 + unit_rows < mm->rows ? r0 + unit_rows : mm->rows;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t wr = e * mm->rows + r;
      kx_mxfp4_decode_row(mm->w + wr * (mm->cols / 2), mm->s + wr * (mm->cols / KX_MX_BLOCK),
                          mm->cols, lut, wrow);
      for (int64_t task = w->expert_first[e]; task < w->expert_first[e + 1]; ++task) {
        const int64_t in_row = mm->task_token ? mm->task_token[task] : task;
        mm->out[task * mm->rows + r] = kx_dot_f32(wrow, mm->in + in_row * mm->cols, mm->cols);
      }
    }
  }
}

/* c * tanh(v / c); an infinite c disables the cap. */
static float cap(float v, float c) { return isinf(c) ? v : c * tanhf(v / c); }

static float silu(float z) { return z / (1.0f + expf(-z)); }

static void run_activation(const kx_cpu_moe_layer *layer, int64_t tasks, moe_work *w) {
  const int64_t inter = layer->inter;
  KX_OMP(for schedule(static))
  for (int64_t task = 0; task < tasks; ++task) {
    const float *a = w->a + task * 2 * inter;
    float *h = w->h + task * inter;
    for (int64_t i = 0; i < inter; ++i)
      h[i] = silu(cap(a[i], layer->beta)) * cap(a[inter + i], layer->linear_beta);
    kx_mxfp8_roundtrip_row(h, inter, layer->hidden_scale, h);
  }
}

static void fill_nan_row(uint16_t *dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = KX_BF16_NAN;
}

/* The value a slot's output row holds: FC2's fp32 result rounded to bf16. */
static float slot_value(float y) { return kx_bf16_widen(kx_bf16_round(y)); }

static void write_slot_rows(const kx_cpu_moe_layer *layer, const kx_cpu_moe_call *call,
                            const moe_work *w) {
  const int64_t hidden = layer->hidden, k = layer->top_k;
  KX_OMP(for schedule(static))
  for (int64_t slot = 0; slot < call->batch * k; ++slot) {
    uint16_t *dst = call->out + slot * call->out_row_stride;
    const int64_t task = w->slot_task[slot];
    if (task == NO_TASK) {
      fill_nan_row(dst, hidden);
      continue;
    }
    const float *y = w->y + task * hidden;
    for (int64_t n = 0; n < hidden; ++n) dst[n] = kx_bf16_round(y[n]);
  }
}

static void write_combined_rows(const kx_cpu_moe_layer *layer, const kx_cpu_moe_call *call,
                                const moe_work *w, float *acc) {
  const int64_t hidden = layer->hidden, k = layer->top_k;
  KX_OMP(for schedule(static))
  for (int64_t t = 0; t < call->batch; ++t) {
    const int64_t *slot_task = w->slot_task + t * k;
    const float *weights = call->route_weights + t * call->weights_row_stride;
    uint16_t *dst = call->out + t * call->out_row_stride;
    int all_valid = 1;
    for (int64_t j = 0; j < k; ++j) all_valid &= slot_task[j] != NO_TASK;
    if (!all_valid) {
      fill_nan_row(dst, hidden);
      continue;
    }
    memset(acc, 0, (size_t)hidden * sizeof(float));
    for (int64_t j = 0; j < k; ++j) { /* slot order, as SPEC 3 fixes it */
      const float *y = w->y + slot_task[j] * hidden;
      for (int64_t n = 0; n < hidden; ++n) acc[n] += weights[j] * slot_value(y[n]);
    }
    for (int64_t n = 0; n < hidden; ++n) dst[n] = kx_bf16_round(acc[n]);
  }
}

/* ---- entry point ---- */

int kx_cpu_moe_run(const kx_cpu_moe_layer *layer, const kx_cpu_moe_call *call,
                   kx_cpu_fault *fault) {
  const int threads = kx_max_threads();
  moe_work w;
  arena ar = {NULL, 0, 0};
  carve_work(&ar, layer, call->batch, threads, &w);
  if (ar.overflow) return -1;
  ar.base = malloc(ar.used > 0 ? ar.used : 1);
  if (!ar.base) return -1;
  ar.used = 0;
  carve_work(&ar, layer, call->batch, threads, &w);

  *fault = count_tasks(layer, call, &w);
  place_tasks(layer, call, &w);
  const int64_t tasks = w.expert_first[layer->experts];
  const int64_t hidden = layer->hidden, inter = layer->inter;
  const expert_matmul fc1 = {layer->w13, layer->s13, 2 * inter, hidden, w.x, w.task_token, w.a};
  const expert_matmul fc2 = {layer->w2, layer->s2, hidden, inter, w.h, NULL, w.y};
  kx_e2m1_pair_lut lut;
  kx_e2m1_pair_lut_init(&lut);

  KX_OMP(parallel num_threads(threads))
  {
    float *row = w.rows + (int64_t)kx_thread_index() * w.row_cap;
    quantize_tokens(layer, call, &w);
    run_expert_matmul(&fc1, &w, &lut, row);
    run_activation(layer, tasks, &w);
    run_expert_matmul(&fc2, &w, &lut, row);
    if (call->route_weights)
      write_combined_rows(layer, call, &w, row);
    else
      write_slot_rows(layer, call, &w);
  }
  free(ar.base);
  return 0;
}
