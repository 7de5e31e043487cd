// What every backend does before its kernel runs: check the arguments, view g as (N, D) rows,
// allocate zero-filled outputs. Kernels only run on non-empty input, so empty tensors give the
// identity of each statistic on every backend without a special case in any kernel.
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "cockpit_fast/arithmetic.h"
#include "cockpit_fast/checks.h"

namespace cockpit_fast {

inline at::TensorOptions accumulation_options(const at::Tensor& g) {
  return g.options().dtype(accumulation_dtype(g.scalar_type()));
}

// Per-sample squared norms (N,) and the sum of squares over samples (D,), zero-filled.
struct SquareNormsArgs {
  at::Tensor rows, l2, sum_sq;
};

inline SquareNormsArgs square_norms_args(const char* op, const at::Tensor& g, double scale) {
  check_grad(op, g, scale);
  at::Tensor rows = as_rows(g);
  return {rows, at::zeros({rows.size(0)}, accumulation_options(g)),
          at::zeros({rows.size(1)}, accumulation_options(g))};
}

// Histogram counts are int64: exact at any count, and what the op returns.
struct Hist1dArgs {
  at::Tensor rows, counts;
};

inline Hist1dArgs hist1d_args(const at::Tensor& g, int64_t bins, double lo, double hi,
                              double scale) {
  check_grad("hist1d", g, scale);
  check_bins("hist1d", bins, "");
  check_cells("hist1d", bins);
  check_range("hist1d", lo, hi, bins, g.scalar_type(), "");
  return {as_rows(g), at::zeros({bins}, g.options().dtype(at::kLong))};
}

struct Hist2dArgs {
  at::Tensor rows, param, counts;
};

inline Hist2dArgs hist2d_args(const at::Tensor& g, const at::Tensor& param, int64_t xbins,
                              int64_t ybins, double xlo, double xhi, double ylo, double yhi,
                              double scale) {
  check_grad("hist2d", g, scale);
  check_companion("hist2d", g, param, "param");
  check_bins("hist2d", xbins, "x ");
  check_bins("hist2d", ybins, "y ");
  check_cells("hist2d", xbins);
  check_cells("hist2d", ybins);
  check_cells("hist2d", xbins * ybins);  // both at most 2^24: the product cannot overflow
  check_range("hist2d", xlo, xhi, xbins, g.scalar_type(), "x ");
  check_range("hist2d", ylo, yhi, ybins, g.scalar_type(), "y ");
  return {as_rows(g), param.contiguous().view({-1}),
          at::zeros({xbins, ybins}, g.options().dtype(at::kLong))};
}

struct BatchDotArgs {
  at::Tensor rows, direction, dots;
};

inline BatchDotArgs batch_dot_args(const at::Tensor& g, const at::Tensor& direction,
                                   double scale) {
  check_grad("batch_dot", g, scale);
  check_companion("batch_dot", g, direction, "direction");
  at::Tensor rows = as_rows(g);
  return {rows, direction.contiguous().view({-1}),
          at::zeros({rows.size(0)}, accumulation_options(g))};
}

// hist1d, batch_l2 and batch_dot against k directions from one pass: counts (bins,) int64,
// l2 (N,) and dots (N, k) in the accumulation dtype, zero-filled; directions as (k, D) rows.
struct Hist1dBatchL2BatchDotsArgs {
  at::Tensor rows, directions, counts, l2, dots;
};

inline Hist1dBatchL2BatchDotsArgs hist1d_batch_l2_batch_dots_args(const at::Tensor& g,
                                                                  const at::Tensor& directions,
                                                                  int64_t bins, double lo,
                                                                  double hi, double hist_scale,
                                                                  double scale) {
  const char* op = "hist1d_batch_l2_batch_dots";
  check_grad(op, g, scale);
  check_scale(op, hist_scale, g.scalar_type(), "hist_scale");
  check_directions(op, g, directions);
  check_bins(op, bins, "");
  check_cells(op, bins);
  check_range(op, lo, hi, bins, g.scalar_type(), "");
  at::Tensor rows = as_rows(g);
  const int64_t k = directions.size(0);
  return {rows, directions.contiguous().view({k, rows.size(1)}),
          at::zeros({bins}, g.options().dtype(at::kLong)),
          at::zeros({rows.size(0)}, accumulation_options(g)),
          at::zeros({rows.size(0), k}, accumulation_options(g))};
}

// hist1d_batch_l2_batch_dots of per-sample gradients G[n] = left[n]^T right[n] (p, q), given as
// their factors left (N, T, p) and right (N, T, q); directions (k, p, q). Contiguous factors and
// directions, outputs as hist1d_batch_l2_batch_dots_args gives them.
struct FactoredHist1dBatchL2BatchDotsArgs {
  at::Tensor left, right, directions, counts, l2, dots;
};

inline FactoredHist1dBatchL2BatchDotsArgs factored_hist1d_batch_l2_batch_dots_args(
    const at::Tensor& left, const at::Tensor& right, const at::Tensor& directions, int64_t bins,
    double lo, double hi, double hist_scale, double scale) {
  const char* op = "factored_hist1d_batch_l2_batch_dots";
  check_factor_pair(op, left, right, 3, "(N, T, features)");
  TORCH_CHECK_VALUE(right.size(0) == left.size(0) && right.size(1) == left.size(1), "cockpit_fast.",
                    op, ": left and right must have the same (N, T), got ", left.sizes().slice(0, 2),
                    " and ", right.sizes().slice(0, 2));
  check_scale(op, scale, left.scalar_type());
  check_scale(op, hist_scale, left.scalar_type(), "hist_scale");
  TORCH_CHECK_VALUE(directions.device() == left.device(), "cockpit_fast.", op, ": left is on ",
                    left.device(), " but directions is on ", directions.device());
  TORCH_CHECK_VALUE(directions.scalar_type() == left.scalar_type(), "cockpit_fast.", op,
                    ": left is ", left.scalar_type(), " but directions is ",
                    directions.scalar_type());
  const int64_t p = left.size(2), q = right.size(2);
  TORCH_CHECK_VALUE(directions.dim() == 3 && directions.size(1) == p && directions.size(2) == q,
                    "cockpit_fast.", op, ": directions must have shape (k, left.shape[2], "
                    "right.shape[2]) = (k, ", p, ", ", q, "), got ", directions.sizes());
  check_bins(op, bins, "");
  check_cells(op, bins);
  check_range(op, lo, hi, bins, left.scalar_type(), "");
  const int64_t n = left.size(0), k = directions.size(0);
  return {left.contiguous(), right.contiguous(), directions.contiguous(),
          at::zeros({bins}, left.options().dtype(at::kLong)),
          at::zeros({n}, accumulation_options(left)),
          at::zeros({n, k}, accumulation_options(left))};
}

// Rows start as the summary of no values, which is also what an empty row must report.
struct PerSampleStatsArgs {
  at::Tensor rows, stats;
};

inline PerSampleStatsArgs per_sample_stats_args(const at::Tensor& g, double scale,
                                                const std::vector<double>& p_values) {
  check_grad("per_sample_stats", g, scale);
  check_p_values("per_sample_stats", p_values, g.scalar_type());
  at::Tensor rows = as_rows(g);
  const int64_t width = kPowSum0 + static_cast<int64_t>(p_values.size());
  at::Tensor stats = at::zeros({rows.size(0), width}, accumulation_options(g));
  stats.select(1, kMax).fill_(-std::numeric_limits<double>::infinity());
  stats.select(1, kMin).fill_(std::numeric_limits<double>::infinity());
  return {rows, stats};
}

// The outer-product histograms: contiguous factors and zeroed int64 counts.
struct OuterHist1dArgs {
  at::Tensor left, right, counts;
};

inline OuterHist1dArgs outer_hist1d_args(const at::Tensor& left, const at::Tensor& right,
                                         int64_t bins, double lo, double hi, double scale) {
  check_factors("outer_hist1d", left, right, scale);
  check_bins("outer_hist1d", bins, "");
  check_cells("outer_hist1d", bins);
  check_range("outer_hist1d", lo, hi, bins, left.scalar_type(), "");
  return {left.contiguous(), right.contiguous(), at::zeros({bins}, left.options().dtype(at::kLong))};
}

struct OuterHist2dArgs {
  at::Tensor left, right, param, counts;
};

inline OuterHist2dArgs outer_hist2d_args(const at::Tensor& left, const at::Tensor& right,
                                         const at::Tensor& param, int64_t xbins, int64_t ybins,
                                         double xlo, double xhi, double ylo, double yhi,
                                         double scale) {
  check_factors("outer_hist2d", left, right, scale);
  TORCH_CHECK_VALUE(param.device() == left.device(), "cockpit_fast.outer_hist2d: left is on ",
                    left.device(), " but param is on ", param.device());
  TORCH_CHECK_VALUE(param.scalar_type() == left.scalar_type(),
                    "cockpit_fast.outer_hist2d: left is ", left.scalar_type(), " but param is ",
                    param.scalar_type());
  TORCH_CHECK_VALUE(param.dim() == 2 && param.size(0) == left.size(1) &&
                        param.size(1) == right.size(1),
                    "cockpit_fast.outer_hist2d: param must have shape (left.shape[1], "
                    "right.shape[1]) = (",
                    left.size(1), ", ", right.size(1), "), got ", param.sizes());
  check_bins("outer_hist2d", xbins, "x ");
  check_bins("outer_hist2d", ybins, "y ");
  check_cells("outer_hist2d", xbins);
  check_cells("outer_hist2d", ybins);
  check_cells("outer_hist2d", xbins * ybins);
  check_range("outer_hist2d", xlo, xhi, xbins, left.scalar_type(), "x ");
  check_range("outer_hist2d", ylo, yhi, ybins, left.scalar_type(), "y ");
  return {left.contiguous(), right.contiguous(), param.contiguous(),
          at::zeros({xbins, ybins}, left.options().dtype(at::kLong))};
}

}  // namespace cockpit_fast
