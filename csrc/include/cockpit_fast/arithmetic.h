// The per-element arithmetic of every op, as __host__ __device__ inline functions: the CPU
// kernels and the CUDA kernels call these very functions, so the CPU tests exercise the
// arithmetic the GPU runs and only the parallel skeletons differ.
//
// Values are computed in opmath (float for float16/bfloat16/float32, double for float64).
// Builds disable floating-point contraction (-ffp-contract=off, nvcc --fmad=false) so that
// scale * g - lo is never fused into one FMA: the bin arithmetic must round exactly as torch's.
#pragma once

#include <ATen/OpMathType.h>
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

// max / min that propagate NaN, as torch.amax / torch.amin do. Bitwise | (no short circuit,
// no branch) lets CPU compilers vectorise the loops that use them.
template <typename T>
C10_HOST_DEVICE inline T nan_max(T a, T b) {
  return (is_nan(a) | (a > b)) ? a : b;
}
template <typename T>
C10_HOST_DEVICE inline T nan_min(T a, T b) {
  return (is_nan(a) | (a < b)) ? a : b;
}

// Histogram slots are int32: checks.h caps a histogram at kMaxBins cells, and 32-bit
// conversions and selects vectorise where 64-bit ones do not. The code is branch-free (selects)
// for the same reason, and never converts NaN to an integer.

// ---------------------------------------------------------------------------------------------
// hist1d: clamp into [lo, hi], then torch.histc's CPU bin rule
//   pos = (x - lo) * bins / (hi - lo), the last bin closed.
template <typename acc_t>
struct Hist1dBins {
  acc_t lo, hi, span;  // span = hi - lo, rounded as histc rounds it
  // 1 / span when span is a power of two, else 0. Dividing by a power of two and multiplying
  // by its inverse round the same exact value, so the bins are the same; a product is several
  // times cheaper than a division in a CPU's vector unit.
  acc_t inverse_span;
  int32_t bins;  // slot `bins` collects what is not counted (NaN)
};

template <typename acc_t>
inline Hist1dBins<acc_t> make_hist1d_bins(int64_t bins, double lo, double hi) {
  const acc_t lo_acc = static_cast<acc_t>(lo), hi_acc = static_cast<acc_t>(hi);
  const acc_t span = hi_acc - lo_acc;
  int exponent = 0;
  const bool power_of_two = std::isfinite(span) && std::frexp(span, &exponent) == acc_t(0.5);
  const acc_t inverse = power_of_two ? std::ldexp(acc_t(1), 1 - exponent) : acc_t(0);
  return {lo_acc, hi_acc, span, std::isnormal(inverse) ? inverse : acc_t(0),
          static_cast<int32_t>(bins)};
}

// The bin of x; kMultiply (only when b.inverse_span is set) multiplies by the inverse span.
template <bool kMultiply = false, typename acc_t>
C10_HOST_DEVICE inline int32_t hist1d_slot(acc_t x, const Hist1dBins<acc_t>& b) {
  const bool nan = is_nan(x);
  // Written so that NaN fails the first comparison and becomes lo: no separate NaN select,
  // which keeps the CPU's vectorised loop short.
  acc_t clamped = x >= b.lo ? x : b.lo;
  clamped = clamped <= b.hi ? clamped : b.hi;
  const acc_t scaled = (clamped - b.lo) * static_cast<acc_t>(b.bins);
  const int32_t pos = static_cast<int32_t>(kMultiply ? scaled * b.inverse_span : scaled / b.span);
  const int32_t bin = pos >= b.bins ? b.bins - 1 : pos;
  return nan ? b.bins : bin;
}

// ---------------------------------------------------------------------------------------------
// outer_hist1d / outer_hist2d: one element u * v of a per-sample outer product, rounded to the
// input dtype exactly as the materialised per-sample gradient (BackPACK's product) is rounded.
// Products of two float16/bfloat16 values are exact in float, so the one rounding is the cast.
template <typename scalar_t>
C10_HOST_DEVICE inline scalar_t outer_element(scalar_t u, scalar_t v) {
  using acc_t = at::opmath_type<scalar_t>;
  return static_cast<scalar_t>(static_cast<acc_t>(u) * static_cast<acc_t>(v));
}

// ---------------------------------------------------------------------------------------------
// hist2d, one axis: Cockpit's GradHist2d rule. Clamp to the centres of the outer bins (bounds
// computed in double, as Python computes them), then truncate (x - lo) / width.
template <typename acc_t>
struct Hist2dAxis {
  acc_t lo, width, clamp_lo, clamp_hi;
  int32_t bins;
};

template <typename acc_t>
inline Hist2dAxis<acc_t> make_hist2d_axis(int64_t bins, double lo, double hi) {
  const double width = (hi - lo) / static_cast<double>(bins);
  return {static_cast<acc_t>(lo), static_cast<acc_t>(width), static_cast<acc_t>(lo + width / 2),
          static_cast<acc_t>(hi - width / 2), static_cast<int32_t>(bins)};
}

// Bin of x along one axis, or -1 for NaN.
template <typename acc_t>
C10_HOST_DEVICE inline int32_t hist2d_axis_bin(acc_t x, const Hist2dAxis<acc_t>& a) {
  const bool nan = is_nan(x);
  acc_t clamped = x < a.clamp_lo ? a.clamp_lo : x;
  clamped = clamped > a.clamp_hi ? a.clamp_hi : clamped;
  clamped = nan ? a.clamp_lo : clamped;
  const int32_t i = static_cast<int32_t>((clamped - a.lo) / a.width);
  // Clamping to bin centres keeps i in range; the guard only matters for huge bin counts.
  const int32_t bin = i < 0 ? 0 : (i >= a.bins ? a.bins - 1 : i);
  return nan ? -1 : bin;
}

// Slot of a pair (x bin, y bin) in the row-major (xbins, ybins) histogram; `discard` (the slot
// after the last cell) when either coordinate was NaN.
C10_HOST_DEVICE inline int32_t hist2d_slot(int32_t x_bin, int32_t y_bin, int32_t ybins,
                                           int32_t discard) {
  // Either bin is -1 exactly when their bitwise or is negative: one test, no branch.
  return (x_bin | y_bin) < 0 ? discard : x_bin * ybins + y_bin;
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

// The lanes of one block are independent: saying so lets GCC vectorise the extremes' loop,
// which it would otherwise take for a select reduction it cannot vectorise.
#if defined(_OPENMP) && !defined(__CUDA_ARCH__)
#define COCKPIT_FAST_LANES_SIMD _Pragma("omp simd")
#else
#define COCKPIT_FAST_LANES_SIMD
#endif

// Sums and extremes run over kLanes independent accumulators, combined in a fixed order: the
// compiler can then vectorise them (it may not reorder one running sum), and results do not
// depend on anything but the values.
constexpr int kLanes = 8;

template <typename acc_t, typename Term>
C10_HOST_DEVICE inline acc_t lane_sum(const acc_t* values, int64_t len, const Term& term) {
  acc_t lanes[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    COCKPIT_FAST_LANES_SIMD
    for (int k = 0; k < kLanes; ++k) lanes[k] += term(values[i + k]);
  }
  for (; i < len; ++i) lanes[0] += term(values[i]);
  acc_t total = 0;
  for (int k = 0; k < kLanes; ++k) total += lanes[k];
  return total;
}

template <typename acc_t>
struct ShiftedTerm {  // x - shift
  acc_t shift;
  C10_HOST_DEVICE acc_t operator()(acc_t x) const { return x - shift; }
};

template <typename acc_t>
struct DividedTerm {  // x / count: partial sums stay within the values' own range
  acc_t count;
  C10_HOST_DEVICE acc_t operator()(acc_t x) const { return x / count; }
};

template <typename acc_t>
struct CentredSquareTerm {  // (x - mean)^2
  acc_t mean;
  C10_HOST_DEVICE acc_t operator()(acc_t x) const { return (x - mean) * (x - mean); }
};

template <typename acc_t>
struct AbsTerm {
  C10_HOST_DEVICE acc_t operator()(acc_t x) const { return x < 0 ? -x : x; }
};

template <typename acc_t>
struct SquareTerm {
  C10_HOST_DEVICE acc_t operator()(acc_t x) const { return x * x; }
};

template <typename acc_t>
struct AbsPowTerm {  // |x|^p
  acc_t p;
  C10_HOST_DEVICE acc_t operator()(acc_t x) const { return std::pow(x < 0 ? -x : x, p); }
};

// sum |x|^p, choosing the loop outside it: p = 1 and p = 2 (the common norms) then vectorise
// and skip pow.
template <typename acc_t>
C10_HOST_DEVICE inline acc_t pow_sum(const acc_t* values, int64_t len, acc_t p) {
  if (p == acc_t(1)) return lane_sum(values, len, AbsTerm<acc_t>{});
  if (p == acc_t(2)) return lane_sum(values, len, SquareTerm<acc_t>{});
  return lane_sum(values, len, AbsPowTerm<acc_t>{p});
}

// Summary of values[0..len): one pass for the extremes, then the mean (summing x - values[0],
// so that a large common offset does not swamp the sum), then the second moment around that
// mean and one pass per p. The run is in registers or cache: no pass re-reads memory.
template <typename acc_t>
C10_HOST_DEVICE inline Summary<acc_t> summarize_values(const acc_t* values, int64_t len,
                                                       const PValues<acc_t>& p) {
  Summary<acc_t> s;
  summary_init(s);
  if (len == 0) return s;
  acc_t max[kLanes], min[kLanes], max_abs[kLanes];
  for (int k = 0; k < kLanes; ++k) {
    max[k] = s.max;
    min[k] = s.min;
    max_abs[k] = 0;
  }
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes) {
    COCKPIT_FAST_LANES_SIMD
    for (int k = 0; k < kLanes; ++k) {
      const acc_t x = values[i + k];
      max[k] = nan_max(max[k], x);
      min[k] = nan_min(min[k], x);
      max_abs[k] = nan_max(max_abs[k], x < 0 ? -x : x);
    }
  }
  for (; i < len; ++i) {
    const acc_t x = values[i];
    max[0] = nan_max(max[0], x);
    min[0] = nan_min(min[0], x);
    max_abs[0] = nan_max(max_abs[0], x < 0 ? -x : x);
  }
  for (int k = 0; k < kLanes; ++k) {
    s.max = nan_max(s.max, max[k]);
    s.min = nan_min(s.min, min[k]);
    s.max_abs = nan_max(s.max_abs, max_abs[k]);
  }
  s.count = static_cast<acc_t>(len);
  // Shifting by an infinite value would turn every difference into NaN.
  const acc_t shift = values[0] - values[0] == 0 ? values[0] : acc_t(0);
  s.mean = shift + lane_sum(values, len, ShiftedTerm<acc_t>{shift}) / s.count;
  // Finite values of both signs near the top of the range overflow x - shift or its sum, and
  // that overflow can meet a true infinity of the other sign (inf - inf = NaN). Partial sums of
  // x / count never overflow, so they give the mean whenever the first sum is not finite: a
  // finite mean, the sign of the infinities present, or NaN (rarely needed: a second pass).
  if (s.mean - s.mean != 0) s.mean = lane_sum(values, len, DividedTerm<acc_t>{s.count});
  s.m2 = lane_sum(values, len, CentredSquareTerm<acc_t>{s.mean});
  for (int j = 0; j < p.count; ++j) s.pow_sum[j] = pow_sum(values, len, p.p[j]);
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
  // An infinite mean makes delta infinite (or NaN), and Chan's update would give inf - inf =
  // NaN where the mean is +-inf: weigh the two means directly then.
  a.mean = delta - delta == 0 ? a.mean + delta * (b.count / n)
                              : a.mean * (a.count / n) + b.mean * (b.count / n);
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
