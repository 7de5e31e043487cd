// Input checks shared by the CPU and CUDA entry points, for direct torch.ops.cockpit_fast calls:
// the Python wrappers check every argument with cockpit_fast/_validation.py before dispatching.
// Every failure is a ValueError that names the op and the problem, as the Python checks say it.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace cockpit_fast {

// The limits are written once, in cockpit_fast/_limits.py; setup.py passes them in.
#if !defined(COCKPIT_FAST_MAX_P_VALUES) || !defined(COCKPIT_FAST_MAX_BINS)
#error "build with setup.py, which defines the limits of cockpit_fast/_limits.py"
#endif

// Most p values one per_sample_stats call takes: the kernels keep one running sum per p in a
// fixed-size state.
constexpr int kMaxP = COCKPIT_FAST_MAX_P_VALUES;

// Most cells one histogram may have: slots are int32, and float32 values cannot resolve more
// bins than this anyway.
constexpr int64_t kMaxBins = COCKPIT_FAST_MAX_BINS;

inline at::ScalarType accumulation_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

inline const char* accumulation_name(at::ScalarType dtype) {
  return accumulation_dtype(dtype) == at::kDouble ? "float64" : "float32";
}

// v as the kernels use it: rounded to the accumulation type of `dtype`, to nearest as the cast
// rounds (a v just above float32's max rounds to it; from the midpoint to 2^128 on, to +-inf).
inline double as_accumulated(double v, at::ScalarType dtype) {
  if (accumulation_dtype(dtype) == at::kDouble || !std::isfinite(v)) return v;
  if (std::fabs(v) >= 0x1.ffffffp127) return std::copysign(INFINITY, v);
  return static_cast<float>(v);
}

// scale multiplies every value in the accumulation type; finite in double is not enough.
inline void check_scale(const char* op, double scale, at::ScalarType dtype,
                        const char* name = "scale") {
  TORCH_CHECK_VALUE(std::isfinite(as_accumulated(scale, dtype)), "cockpit_fast.", op, ": ", name,
                    " must be finite in ", accumulation_name(dtype),
                    ", the precision it multiplies in, got ", scale);
}

inline void check_grad(const char* op, const at::Tensor& g, double scale) {
  TORCH_CHECK_VALUE(g.dim() >= 1, "cockpit_fast.", op,
                    ": g must have a leading batch dimension (N, *param_shape), got a ", g.dim(),
                    "-d tensor");
  const auto dtype = g.scalar_type();
  TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                        dtype == at::kBFloat16,
                    "cockpit_fast.", op, ": g must be float16, bfloat16, float32 or float64, got ",
                    dtype);
  check_scale(op, scale, dtype);
}

// Two factors of per-sample gradients, `dims`-d (`layout` names the dimensions), floating
// point, on one device in one dtype.
inline void check_factor_pair(const char* op, const at::Tensor& left, const at::Tensor& right,
                              int64_t dims, const char* layout) {
  for (const at::Tensor* t : {&left, &right}) {
    const char* name = t == &left ? "left" : "right";
    TORCH_CHECK_VALUE(t->dim() == dims, "cockpit_fast.", op, ": ", name, " must be a ", dims, "-d ",
                      layout, " tensor, got a ", t->dim(), "-d tensor");
    const auto dtype = t->scalar_type();
    TORCH_CHECK_VALUE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf ||
                          dtype == at::kBFloat16,
                      "cockpit_fast.", op, ": ", name,
                      " must be float16, bfloat16, float32 or float64, got ", dtype);
  }
  TORCH_CHECK_VALUE(right.device() == left.device(), "cockpit_fast.", op, ": left is on ",
                    left.device(), " but right is on ", right.device());
  TORCH_CHECK_VALUE(right.scalar_type() == left.scalar_type(), "cockpit_fast.", op, ": left is ",
                    left.scalar_type(), " but right is ", right.scalar_type());
}

// The two factors (N, p) and (N, q) of per-sample outer products: same N, dtype and device.
inline void check_factors(const char* op, const at::Tensor& left, const at::Tensor& right,
                          double scale) {
  check_factor_pair(op, left, right, 2, "(N, features)");
  TORCH_CHECK_VALUE(right.size(0) == left.size(0), "cockpit_fast.", op,
                    ": left and right must have the same number of samples, got ", left.size(0),
                    " and ", right.size(0));
  check_scale(op, scale, left.scalar_type());
}

// A parameter or direction must match g's per-sample shape, device and dtype.
inline void check_companion(const char* op, const at::Tensor& g, const at::Tensor& other,
                            const char* name) {
  TORCH_CHECK_VALUE(other.device() == g.device(), "cockpit_fast.", op, ": g is on ", g.device(),
                    " but ", name, " is on ", other.device());
  TORCH_CHECK_VALUE(other.scalar_type() == g.scalar_type(), "cockpit_fast.", op, ": g is ",
                    g.scalar_type(), " but ", name, " is ", other.scalar_type());
  TORCH_CHECK_VALUE(other.sizes() == g.sizes().slice(1), "cockpit_fast.", op, ": ", name,
                    " must have shape g.shape[1:] = ", g.sizes().slice(1), ", got ",
                    other.sizes());
}

// Directions (k, *param_shape), k >= 0: each one a companion of g.
inline void check_directions(const char* op, const at::Tensor& g, const at::Tensor& directions) {
  TORCH_CHECK_VALUE(directions.device() == g.device(), "cockpit_fast.", op, ": g is on ",
                    g.device(), " but directions is on ", directions.device());
  TORCH_CHECK_VALUE(directions.scalar_type() == g.scalar_type(), "cockpit_fast.", op, ": g is ",
                    g.scalar_type(), " but directions is ", directions.scalar_type());
  if (directions.dim() != g.dim() || directions.sizes().slice(1) != g.sizes().slice(1)) {
    std::string expected = "(k";
    for (int64_t size : g.sizes().slice(1)) expected += ", " + std::to_string(size);
    TORCH_CHECK_VALUE(false, "cockpit_fast.", op, ": directions must have shape (k, *g.shape[1:]) = ",
                      expected, g.dim() == 1 ? ",)" : ")", ", got ", directions.sizes());
  }
}

inline void check_bins(const char* op, int64_t bins, const char* axis) {
  TORCH_CHECK_VALUE(bins > 0, "cockpit_fast.", op, ": ", axis,
                    "bins must be a positive integer, got ", bins);
}

inline void check_cells(const char* op, int64_t cells) {
  TORCH_CHECK_VALUE(cells <= kMaxBins, "cockpit_fast.", op, ": at most ", kMaxBins,
                    " histogram cells, got ", cells);
}

// Whether `bins` bins over (lo, hi) can be computed in T: bounds that stay ordered, a finite
// span * bins (hist1d's intermediate) and a nonzero bin width (hist2d's divisor).
template <typename T>
inline bool range_fits(double lo, double hi, int64_t bins) {
  const T l = static_cast<T>(lo), h = static_cast<T>(hi);
  return l < h && std::isfinite((h - l) * static_cast<T>(bins)) &&
         static_cast<T>((hi - lo) / static_cast<double>(bins)) > T(0);
}

// The bin arithmetic runs in the accumulation type of `dtype` (float32 unless float64): a
// range that is fine in double can overflow or round to an empty one there, and the bin
// indices would then be garbage.
inline void check_range(const char* op, double lo, double hi, int64_t bins,
                        at::ScalarType dtype, const char* axis) {
  TORCH_CHECK_VALUE(std::isfinite(lo) && std::isfinite(hi), "cockpit_fast.", op, ": ", axis,
                    "range bounds must be finite, got (", lo, ", ", hi, ")");
  TORCH_CHECK_VALUE(lo < hi, "cockpit_fast.", op, ": ", axis, "range needs lo < hi, got (", lo,
                    ", ", hi, ")");
  const bool wide = accumulation_dtype(dtype) == at::kDouble;
  TORCH_CHECK_VALUE(wide ? range_fits<double>(lo, hi, bins) : range_fits<float>(lo, hi, bins),
                    "cockpit_fast.", op, ": ", axis, "range (", lo, ", ", hi, ") with ", bins,
                    " bins overflows or rounds to nothing in ", accumulation_name(dtype),
                    ", the precision the bins are computed in");
}

// The powers run in the accumulation type: a p that rounds to 0 or inf there is rejected too.
inline void check_p_values(const char* op, const std::vector<double>& p_values,
                           at::ScalarType dtype) {
  TORCH_CHECK_VALUE(p_values.size() <= static_cast<size_t>(kMaxP), "cockpit_fast.", op,
                    ": at most ", kMaxP, " p values per call, got ", p_values.size());
  for (double p : p_values) {
    const double used = as_accumulated(p, dtype);
    TORCH_CHECK_VALUE(std::isfinite(used) && used > 0, "cockpit_fast.", op,
                      ": p values must be finite and > 0 in ", accumulation_name(dtype),
                      " (use the max_abs column for p = inf), got ", p);
  }
}

// g as a contiguous (N, D) matrix; non-contiguous input is copied once.
inline at::Tensor as_rows(const at::Tensor& g) {
  int64_t per_sample = 1;  // explicit, since view(N, -1) is ambiguous when N == 0
  for (int64_t d = 1; d < g.dim(); ++d) per_sample *= g.size(d);
  return g.contiguous().view({g.size(0), per_sample});
}

}  // namespace cockpit_fast
