// CUDA kernel of outer_hist2d. Same virtual (N * p, q) matrix of per-sample products as
// outer_hist1d (row r = n * p + i), walked by the row-tile histogram skeleton
// (cuda_histogram.cuh); the y coordinate of element (r, j) is param[i, j], read alongside.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "cockpit_fast/cuda_histogram.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

// Scalar loads of 4 neighbouring values per thread: a warp's loads span 128 contiguous values,
// served by the same cache lines, and the row bookkeeping is amortised.
template <typename scalar_t>
struct OuterHist2dSlots {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr int kVec = 4;
  const scalar_t* left;
  const scalar_t* right;
  const scalar_t* param;
  int64_t p, q;
  Hist2dAxis<acc_t> x_axis, y_axis;
  acc_t scale;

  struct Column {
    int64_t j;
  };

  __device__ __forceinline__ Column column(int64_t j) const { return {j}; }

  __device__ __forceinline__ void slots(const Column& c, int64_t r, int32_t (&out)[kVec]) const {
    const int32_t discard = x_axis.bins * y_axis.bins;
    const scalar_t u = left[r];
    const scalar_t* v = right + (r / p) * q;
    const scalar_t* w = param + (r % p) * q;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t j = c.j + k;
      out[k] = discard;
      if (j < q) {
        const acc_t x = scale * static_cast<acc_t>(outer_element(u, v[j]));
        const int32_t y_bin = hist2d_axis_bin(static_cast<acc_t>(w[j]), y_axis);
        out[k] = hist2d_slot(hist2d_axis_bin(x, x_axis), y_bin, y_axis.bins, discard);
      }
    }
  }
};

at::Tensor outer_hist2d_cuda(const at::Tensor& left, const at::Tensor& right,
                             const at::Tensor& param, int64_t xbins, int64_t ybins, double xlo,
                             double xhi, double ylo, double yhi, double scale) {
  OuterHist2dArgs args =
      outer_hist2d_args(left, right, param, xbins, ybins, xlo, xhi, ylo, yhi, scale);
  const int64_t p = args.left.size(1), q = args.right.size(1);
  const int64_t n_rows = args.left.numel();
  if (n_rows > 0 && q > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, left.scalar_type(), "outer_hist2d", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const OuterHist2dSlots<scalar_t> op{args.left.const_data_ptr<scalar_t>(),
                                          args.right.const_data_ptr<scalar_t>(),
                                          args.param.const_data_ptr<scalar_t>(),
                                          p,
                                          q,
                                          make_hist2d_axis<acc_t>(xbins, xlo, xhi),
                                          make_hist2d_axis<acc_t>(ybins, ylo, yhi),
                                          static_cast<acc_t>(scale)};
      count_row_tiles(op, n_rows, q, args.counts);
    });
  }
  return args.counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("outer_hist2d", &outer_hist2d_cuda); }

}  // namespace cockpit_fast
