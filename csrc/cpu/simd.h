// Wider vector instructions for the CPU kernels' hot loops, chosen when the library loads.
//
// The build targets baseline x86-64 (SSE2) so that the library runs on every x86-64 CPU. The
// few hot loops (values to histogram slots, per-sample summaries, dot and square tiles) are
// compiled again for AVX2 and AVX-512 (GCC function multi-versioning), and the loader picks
// the widest the CPU has. Every version runs the same IEEE operations in the same order (no FMA
// contraction, no reciprocal approximations, no reassociation), so all give the same results.
#pragma once

#include <cstdint>

#include "cockpit_fast/arithmetic.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 12
// flatten: the per-element functions must be inlined into each version to use its instructions.
#define COCKPIT_FAST_SIMD_CLONES \
  __attribute__((flatten, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#elif defined(__GNUC__)
#define COCKPIT_FAST_SIMD_CLONES __attribute__((flatten))
#else
#define COCKPIT_FAST_SIMD_CLONES
#endif

namespace cockpit_fast {

// hist1d slots of scale * x[0..len).
template <bool kMultiply, typename scalar_t, typename acc_t>
COCKPIT_FAST_SIMD_CLONES void hist1d_slots(const scalar_t* x, int64_t len, acc_t scale,
                                           Hist1dBins<acc_t> b, int32_t* slots) {
  for (int64_t i = 0; i < len; ++i) {
    slots[i] = hist1d_slot<kMultiply>(scale * static_cast<acc_t>(x[i]), b);
  }
}

// hist1d slots of scale * (u * v[j]) for j in [0, len): one row of a per-sample outer product,
// each element rounded as the formed product would be.
template <bool kMultiply, typename scalar_t, typename acc_t>
COCKPIT_FAST_SIMD_CLONES void outer_hist1d_slots(scalar_t u, const scalar_t* v, int64_t len, acc_t scale,
                                                 Hist1dBins<acc_t> b, int32_t* slots) {
  for (int64_t j = 0; j < len; ++j) {
    slots[j] = hist1d_slot<kMultiply>(scale * static_cast<acc_t>(outer_element(u, v[j])), b);
  }
}

// hist2d slots of the pairs (scale * x[j], column j) for j in [0, len), given each column's y
// bin (-1 for NaN).
template <typename scalar_t, typename acc_t>
COCKPIT_FAST_SIMD_CLONES void hist2d_slots(const scalar_t* x, const int32_t* y_bins, int64_t len,
                                           acc_t scale, Hist2dAxis<acc_t> x_axis, int32_t ybins,
                                           int32_t discard, int32_t* slots) {
  for (int64_t j = 0; j < len; ++j) {
    const int32_t x_bin = hist2d_axis_bin(scale * static_cast<acc_t>(x[j]), x_axis);
    slots[j] = hist2d_slot(x_bin, y_bins[j], ybins, discard);
  }
}

// hist2d slots of the pairs (scale * (u * v[j]), column j): one row of a per-sample outer
// product, each element rounded as the formed product would be.
template <typename scalar_t, typename acc_t>
COCKPIT_FAST_SIMD_CLONES void outer_hist2d_slots(scalar_t u, const scalar_t* v,
                                                 const int32_t* y_bins, int64_t len, acc_t scale,
                                                 Hist2dAxis<acc_t> x_axis, int32_t ybins,
                                                 int32_t discard, int32_t* slots) {
  for (int64_t j = 0; j < len; ++j) {
    const acc_t x = scale * static_cast<acc_t>(outer_element(u, v[j]));
    slots[j] = hist2d_slot(hist2d_axis_bin(x, x_axis), y_bins[j], ybins, discard);
  }
}

// per_sample_stats: the summary of scale * x[0..len), with `values` as room for the scaled run.
template <typename scalar_t, typename acc_t>
COCKPIT_FAST_SIMD_CLONES Summary<acc_t> summarize_run(const scalar_t* x, int64_t len, acc_t scale,
                                                      PValues<acc_t> p, acc_t* values) {
  for (int64_t j = 0; j < len; ++j) values[j] = scale * static_cast<acc_t>(x[j]);
  return summarize_values(values, len, p);
}

}  // namespace cockpit_fast
