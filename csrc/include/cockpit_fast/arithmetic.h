// The per-element arithmetic of every op, as __host__ __device__ inline functions: the CPU
// kernels and the CUDA kernels call these very functions, so the CPU tests exercise the
// arithmetic the GPU runs and only the parallel skeletons differ.
//
// Values are computed in opmath (float for float16/bfloat16/float32, double for float64).
// Builds disable floating-point contraction (-ffp-contract=off, nvcc --fmad=false) so that
// scale * g - lo is never fused into one FMA: the bin arithmetic must round exactly as torch's.
#pragma once

#include <c10/macros/Macros.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "cockpit_fast/checks.h"

namespace cockpit_fast {

template <typename T>
C10_HOST_DEVICE inline bool is_nan(T x) {
  return x != x;
}

// max / min that propagate NaN, as torch.amax / torch.amin do.
template <typename T>
C10_HOST_DEVICE inline T nan_max(T a, T b) {
  return (is_nan(a) || a > b) ? a : b;
}
template <typename T>
C10_HOST_DEVICE inline T nan_min(T a, T b) {
  return (is_nan(a) || a < b) ? a : b;
}

// ---------------------------------------------------------------------------------------------
// hist1d: clamp into [lo, hi], then torch.histc's CPU bin rule
//   pos = (x - lo) * bins / (hi - lo), the last bin closed.
template <typename acc_t>
struct Hist1dBins {
  acc_t lo, hi, span;  // span = hi - lo, rounded as histc rounds it
  int64_t bins;        // slot `bins` collects what is not counted (NaN)
};

template <typename acc_t>
inline Hist1dBins<acc_t> make_hist1d_bins(int64_t bins, double lo, double hi) {
  const acc_t lo_acc = static_cast<acc_t>(lo), hi_acc = static_cast<acc_t>(hi);
  return {lo_acc, hi_acc, hi_acc - lo_acc, bins};
}

template <typename acc_t>
C10_HOST_DEVICE inline int64_t hist1d_slot(acc_t x, const Hist1dBins<acc_t>& b) {
  if (is_nan(x)) return b.bins;
  x = x < b.lo ? b.lo : (x > b.hi ? b.hi : x);
  const int64_t pos = static_cast<int64_t>((x - b.lo) * static_cast<acc_t>(b.bins) / b.span);
  return pos >= b.bins ? b.bins - 1 : pos;
}

// ---------------------------------------------------------------------------------------------
// hist2d, one axis: Cockpit's GradHist2d rule. Clamp to the centres of the outer bins (bounds
// computed in double, as Python computes them), then truncate (x - lo) / width.
template <typename acc_t>
struct Hist2dAxis {
  acc_t lo, width, clamp_lo, clamp_hi;
  int64_t bins;
};

template <typename acc_t>
inline Hist2dAxis<acc_t> make_hist2d_axis(int64_t bins, double lo, double hi) {
  const double width = (hi - lo) / static_cast<double>(bins);
  return {static_cast<acc_t>(lo), static_cast<acc_t>(width), static_cast<acc_t>(lo + width / 2),
          static_cast<acc_t>(hi - width / 2), bins};
}

// Bin of a non-NaN value along one axis.
template <typename acc_t>
C10_HOST_DEVICE inline int64_t hist2d_axis_bin(acc_t x, const Hist2dAxis<acc_t>& a) {
  x = x < a.clamp_lo ? a.clamp_lo : (x > a.clamp_hi ? a.clamp_hi : x);
  const int64_t i = static_cast<int64_t>((x - a.lo) / a.width);
  // Clamping to bin centres keeps i in range; the guard only matters for absurd bin counts.
  return i < 0 ? 0 : (i >= a.bins ? a.bins - 1 : i);
}

// ---------------------------------------------------------------------------------------------
// per_sample_stats: a mergeable summary of a run of values (Welford / Chan et al.).
constexpr int64_t kStatsChunk = 4096;  // values per partial summary, on both backends

template <typename acc_t>
struct PValues {
  acc_t p[kMaxP];
  int count;
};

template <typename acc_t>
struct Summary {
  acc_t count, mean, m2, max, min, max_abs;
  acc_t pow_sum[kMaxP];
};

template <typename acc_t>
C10_HOST_DEVICE inline void summary_init(Summary<acc_t>& s) {
  s.count = 0;
  s.mean = 0;
  s.m2 = 0;
  s.max = -std::numeric_limits<acc_t>::infinity();
  s.min = std::numeric_limits<acc_t>::infinity();
  s.max_abs = 0;
  for (int i = 0; i < kMaxP; ++i) s.pow_sum[i] = 0;
}

template <typename acc_t>
C10_HOST_DEVICE inline acc_t abs_pow(acc_t a, acc_t p) {
  return p == acc_t(1) ? a : (p == acc_t(2) ? a * a : std::pow(a, p));
}

// First pass over a run: everything but m2, which needs the run's mean. The sum is of x - shift
// (a value of the run), so a large common offset does not swamp it.
template <typename acc_t>
C10_HOST_DEVICE inline void summary_add(Summary<acc_t>& s, acc_t x, const PValues<acc_t>& p,
                                        acc_t shift, acc_t& shifted_sum) {
  const acc_t a = std::abs(x);
  s.count += 1;
  shifted_sum += x - shift;
  s.max = nan_max(s.max, x);
  s.min = nan_min(s.min, x);
  s.max_abs = nan_max(s.max_abs, a);
  for (int i = 0; i < kMaxP; ++i) {
    if (i < p.count) s.pow_sum[i] += abs_pow(a, p.p[i]);
  }
}

// Summary of values[0..len): first pass for everything but m2, second pass for m2 around the
// run's mean (the run is in registers or cache, so the second pass costs no memory traffic).
template <typename acc_t>
C10_HOST_DEVICE inline Summary<acc_t> summarize_values(const acc_t* values, int64_t len,
                                                       const PValues<acc_t>& p) {
  Summary<acc_t> s;
  summary_init(s);
  // Shifting by an infinite value would turn every difference into NaN.
  const acc_t shift = (len > 0 && values[0] - values[0] == 0) ? values[0] : acc_t(0);
  acc_t shifted_sum = 0;
  for (int64_t i = 0; i < len; ++i) summary_add(s, values[i], p, shift, shifted_sum);
  if (len > 0) {
    s.mean = shift + shifted_sum / s.count;
    for (int64_t i = 0; i < len; ++i) s.m2 += (values[i] - s.mean) * (values[i] - s.mean);
  }
  return s;
}

// Chan et al.'s merge: exact for counts, stable for the second moment.
template <typename acc_t>
C10_HOST_DEVICE inline void summary_merge(Summary<acc_t>& a, const Summary<acc_t>& b,
                                          const PValues<acc_t>& p) {
  if (b.count == 0) return;
  if (a.count == 0) {
    a = b;
    return;
  }
  const acc_t n = a.count + b.count;
  const acc_t delta = b.mean - a.mean;
  a.mean += delta * (b.count / n);
  a.m2 += b.m2 + delta * delta * (a.count * b.count / n);
  a.count = n;
  a.max = nan_max(a.max, b.max);
  a.min = nan_min(a.min, b.min);
  a.max_abs = nan_max(a.max_abs, b.max_abs);
  for (int i = 0; i < kMaxP; ++i) {
    if (i < p.count) a.pow_sum[i] += b.pow_sum[i];
  }
}

// Row layout of per_sample_stats' output; mirrored by cockpit_fast/stats.py.
enum StatsColumn : int64_t { kMax = 0, kMin, kMean, kM2, kMaxAbs, kPowSum0 };

template <typename acc_t>
C10_HOST_DEVICE inline Summary<double> widen(const Summary<acc_t>& s) {
  Summary<double> w;
  w.count = s.count;
  w.mean = s.mean;
  w.m2 = s.m2;
  w.max = s.max;
  w.min = s.min;
  w.max_abs = s.max_abs;
  for (int i = 0; i < kMaxP; ++i) w.pow_sum[i] = s.pow_sum[i];
  return w;
}

template <typename acc_t>
C10_HOST_DEVICE inline PValues<double> widen(const PValues<acc_t>& p) {
  PValues<double> w;
  w.count = p.count;
  for (int i = 0; i < kMaxP; ++i) w.p[i] = p.p[i];
  return w;
}

// Merges a row's partial summaries in chunk order and writes the output row. The merge runs in
// double: a long row has many chunks, and float sums over them would lose digits.
template <typename acc_t>
C10_HOST_DEVICE inline void summaries_to_row(const Summary<acc_t>* partials, int64_t n_partials,
                                             const PValues<acc_t>& p, acc_t* row) {
  const PValues<double> wide_p = widen(p);
  Summary<double> total;
  summary_init(total);
  for (int64_t c = 0; c < n_partials; ++c) summary_merge(total, widen(partials[c]), wide_p);
  row[kMax] = static_cast<acc_t>(total.max);
  row[kMin] = static_cast<acc_t>(total.min);
  row[kMean] = static_cast<acc_t>(total.mean);
  row[kM2] = static_cast<acc_t>(total.m2);
  row[kMaxAbs] = static_cast<acc_t>(total.max_abs);
  for (int i = 0; i < p.count; ++i) row[kPowSum0 + i] = static_cast<acc_t>(total.pow_sum[i]);
}

template <typename acc_t>
inline PValues<acc_t> make_p_values(const std::vector<double>& p_values) {
  PValues<acc_t> p;
  p.count = static_cast<int>(p_values.size());
  for (int i = 0; i < kMaxP; ++i) p.p[i] = i < p.count ? static_cast<acc_t>(p_values[i]) : 1;
  return p;
}

}  // namespace cockpit_fast
