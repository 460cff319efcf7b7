/* cpu_parallel.h: the one place that knows whether OpenMP is on.
 *
 * KX_OMP(directive) expands to `#pragma omp directive` when compiled with -fopenmp and
 * to nothing otherwise, so the same source builds warning-free both ways (a bare
 * `#pragma omp` trips -Wunknown-pragmas without -fopenmp). Without OpenMP a parallel
 * region simply runs once, on thread 0.
 */
#ifndef KX_CPU_PARALLEL_H
#define KX_CPU_PARALLEL_H

#ifdef _OPENMP
#include <omp.h>
#define KX_PRAGMA(text) _Pragma(#text)
#define KX_OMP(directive) KX_PRAGMA(omp directive)
static inline int kx_max_threads(void) { return omp_get_max_threads(); }
static inline int kx_thread_index(void) { return omp_get_thread_num(); }
#else
#define KX_OMP(directive)
static inline int kx_max_threads(void) { return 1; }
static inline int kx_thread_index(void) { return 0; }
#endif

#endif /* KX_CPU_PARALLEL_H */
