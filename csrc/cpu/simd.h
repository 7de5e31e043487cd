// Wider vector instructions for the CPU kernels' hot loops, chosen when the library loads.
//
// The build targets baseline x86-64 (SSE2) so that the library runs on every x86-64 CPU. The
// few hot loops (values to histogram slots, per-sample summaries, dot and square tiles) are
// compiled again for AVX2 and AVX-512 (GCC function multi-versioning), and the loader picks
// the widest the CPU has. Every version runs the same IEEE operations in the same order (no FMA
// contraction, no reciprocal approximations, no reassociation), so all give the same results.
#pragma once

#include <cstdint>
#include <type_traits>

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

// batch_l2 and batch_dot sum each row in tiles of these many columns: a tile's sum is the
// fixed-order total of kLanes lane sums (value j in lane j % kLanes, the tail in lane 0), a row's
// the double sum of its tiles' in tile order. hist1d_batch_l2_batch_dots sums the same tiles the
// same way, so that it gives the separate ops' very bits.
constexpr int64_t kSquareTileColumns = 1024;  // batch_l2, sum_grad_squared (square_norms.cpp)
constexpr int64_t kDotTileColumns = 2048;     // batch_dot

// batch_dot's tile: sum of (s * x[j]) * d[j], as <scale * g[n], direction> reads (scaling the sum
// instead overflows or underflows where the products do but the scaled products do not).
template <typename scalar_t, typename acc_t>
COCKPIT_FAST_SIMD_CLONES acc_t dot_tile(const scalar_t* x, const scalar_t* d, int64_t len, acc_t s) {
  acc_t lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    COCKPIT_FAST_LANES_SIMD
    for (int k = 0; k < kLanes; ++k) {
      lanes[k] += (s * static_cast<acc_t>(x[j + k])) * static_cast<acc_t>(d[j + k]);
    }
  }
  for (; j < len; ++j) lanes[0] += (s * static_cast<acc_t>(x[j])) * static_cast<acc_t>(d[j]);
  acc_t total = 0;
  for (int k = 0; k < kLanes; ++k) total += lanes[k];
  return total;
}

// Calls kernel(std::integral_constant<int, min(k, 2)>{}): how many of k directions
// hist1d_square_dot_tile takes in its loop (dot_tile takes the rest).
template <typename Kernel>
void with_directions_in_loop(int64_t k, const Kernel& kernel) {
  if (k == 0) {
    kernel(std::integral_constant<int, 0>{});
  } else if (k == 1) {
    kernel(std::integral_constant<int, 1>{});
  } else {
    kernel(std::integral_constant<int, 2>{});
  }
}

// hist1d_batch_l2_batch_dots on one batch_dot tile x[0..len) of a sample (len <= kDotTileColumns),
// each value loaded once: the hist1d slots of hist_scale * x; per batch_l2 tile, the sum of the
// squares of s * x into square_sums[t]; the dot_tile sums against kDirections (0, 1 or 2)
// directions d0, d1 into dot_sums[i]. Lanes, tails and totals as square_tile and dot_tile add
// them. One loop keeps the lanes' chains of additions in flight together (one chain alone waits
// on each addition's latency) while the slot arithmetic fills the gaps.
template <bool kMultiply, int kDirections, typename scalar_t, typename acc_t>
COCKPIT_FAST_SIMD_CLONES void hist1d_square_dot_tile(const scalar_t* x, int64_t len, acc_t hist_scale,
                                                     Hist1dBins<acc_t> b, int32_t* slots, acc_t s,
                                                     acc_t* square_sums, const scalar_t* d0,
                                                     const scalar_t* d1, acc_t* dot_sums) {
  static_assert(kDirections >= 0 && kDirections <= 2, "0, 1 or 2 directions per loop");
  static_assert(kSquareTileColumns % kLanes == 0, "only the last square tile has a tail");
  acc_t dots0[kLanes] = {}, dots1[kLanes] = {};
  for (int64_t t0 = 0; t0 < len; t0 += kSquareTileColumns) {
    const int64_t t_end = t0 + (len - t0 < kSquareTileColumns ? len - t0 : kSquareTileColumns);
    acc_t squares[kLanes] = {};
    int64_t j = t0;
    for (; j + kLanes <= t_end; j += kLanes) {
      COCKPIT_FAST_LANES_SIMD
      for (int k = 0; k < kLanes; ++k) {
        const acc_t value = static_cast<acc_t>(x[j + k]);
        slots[j + k] = hist1d_slot<kMultiply>(hist_scale * value, b);
        const acc_t v = s * value;
        squares[k] += v * v;
        if constexpr (kDirections > 0) dots0[k] += v * static_cast<acc_t>(d0[j + k]);
        if constexpr (kDirections > 1) dots1[k] += v * static_cast<acc_t>(d1[j + k]);
      }
    }
    for (; j < t_end; ++j) {
      const acc_t value = static_cast<acc_t>(x[j]);
      slots[j] = hist1d_slot<kMultiply>(hist_scale * value, b);
      const acc_t v = s * value;
      squares[0] += v * v;
      if constexpr (kDirections > 0) dots0[0] += v * static_cast<acc_t>(d0[j]);
      if constexpr (kDirections > 1) dots1[0] += v * static_cast<acc_t>(d1[j]);
    }
    acc_t total = 0;
    for (int k = 0; k < kLanes; ++k) total += squares[k];
    square_sums[t0 / kSquareTileColumns] = total;
  }
  acc_t total0 = 0, total1 = 0;
  for (int k = 0; k < kLanes; ++k) {
    total0 += dots0[k];
    total1 += dots1[k];
  }
  if constexpr (kDirections > 0) dot_sums[0] = total0;
  if constexpr (kDirections > 1) dot_sums[1] = total1;
}

// per_sample_stats: the summary of scale * x[0..len), with `values` as room for the scaled run.
template <typename scalar_t, typename acc_t>
COCKPIT_FAST_SIMD_CLONES Summary<acc_t> summarize_run(const scalar_t* x, int64_t len, acc_t scale,
                                                      PValues<acc_t> p, acc_t* values) {
  for (int64_t j = 0; j < len; ++j) values[j] = scale * static_cast<acc_t>(x[j]);
  return summarize_values(values, len, p);
}

}  // namespace cockpit_fast
