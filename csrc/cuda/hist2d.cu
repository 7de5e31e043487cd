// CUDA kernel of hist2d: the row-tile histogram skeleton (cuda_histogram.cuh) over g as
// (N, D). Each thread bins its VEC columns' parameter values once into registers, then walks
// the rows binning scale * g[n, j]: the parameter is never expanded over N.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "cockpit_fast/cuda_histogram.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

template <typename scalar_t, int VEC>
struct Hist2dSlots {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr int kVec = VEC;
  const scalar_t* data;
  const scalar_t* param;
  int64_t n_cols;
  Hist2dAxis<acc_t> x_axis, y_axis;
  acc_t scale;

  struct Column {
    int64_t j;
    int32_t y_bin[VEC];  // -1: column out of range or parameter NaN
  };

  __device__ __forceinline__ Column column(int64_t j) const {
    Column c;
    c.j = j;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      c.y_bin[k] = j + k < n_cols ? hist2d_axis_bin(static_cast<acc_t>(param[j + k]), y_axis) : -1;
    }
    return c;
  }

  __device__ __forceinline__ void slots(const Column& c, int64_t n, int32_t (&out)[VEC]) const {
    const int32_t discard = x_axis.bins * y_axis.bins;
    scalar_t values[VEC];
    load_values(data + n * n_cols, c.j, n_cols, values);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const int32_t x_bin = hist2d_axis_bin(scale * static_cast<acc_t>(values[k]), x_axis);
      out[k] = hist2d_slot(x_bin, c.y_bin[k], y_axis.bins, discard);
    }
  }
};

at::Tensor hist2d_cuda(const at::Tensor& g, const at::Tensor& param, int64_t xbins, int64_t ybins,
                       double xlo, double xhi, double ylo, double yhi, double scale) {
  Hist2dArgs args = hist2d_args(g, param, xbins, ybins, xlo, xhi, ylo, yhi, scale);
  const int64_t n_rows = args.rows.size(0), n_cols = args.rows.size(1);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "hist2d", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* data = args.rows.const_data_ptr<scalar_t>();
      const scalar_t* p = args.param.const_data_ptr<scalar_t>();
      const Hist2dAxis<acc_t> x_axis = make_hist2d_axis<acc_t>(xbins, xlo, xhi);
      const Hist2dAxis<acc_t> y_axis = make_hist2d_axis<acc_t>(ybins, ylo, yhi);
      // param is read once per block, value by value: only g's layout sets the vector width.
      with_vector_width<scalar_t>(vector_width<scalar_t>(data, n_cols), [&](auto vec) {
        const Hist2dSlots<scalar_t, decltype(vec)::value> op{data, p, n_cols, x_axis, y_axis,
                                                             static_cast<acc_t>(scale)};
        count_row_tiles(op, n_rows, n_cols, args.counts);
      });
    });
  }
  return args.counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("hist2d", &hist2d_cuda); }

}  // namespace cockpit_fast
