// CUDA kernel of outer_hist2d. Same virtual (N * p, q) matrix of per-sample products as
// outer_hist1d (row r = n * p + i); the y coordinate of element (r, j) is param[i, j], read
// alongside. A block owns a tile of columns and a group of rows; counts go to privatised
// shared-memory histograms (one copy per warp where they fit, warp-aggregated atomics within).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "cockpit_fast/cuda_common.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

template <typename scalar_t, int VEC, bool kShared>
__global__ void outer_hist2d_kernel(const scalar_t* __restrict__ left,
                                    const scalar_t* __restrict__ right,
                                    const scalar_t* __restrict__ param, int64_t n_rows, int64_t p,
                                    int64_t q, int64_t rows_per_group,
                                    Hist2dAxis<at::opmath_type<scalar_t>> x_axis,
                                    Hist2dAxis<at::opmath_type<scalar_t>> y_axis,
                                    at::opmath_type<scalar_t> scale, int copies,
                                    unsigned long long* __restrict__ counts) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned int shared_counts[];
  const int32_t discard = x_axis.bins * y_axis.bins;  // slot of pairs that are not counted
  BlockHistogram<kShared> histogram(shared_counts, discard, copies, counts);
  const int64_t j = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_group;
  const int64_t r_end = min(n_rows, r_begin + rows_per_group);
  for (int64_t r = r_begin; r < r_end; ++r) {  // uniform per block: every lane counts together
    const scalar_t u = left[r];
    const scalar_t* v = right + (r / p) * q;
    const scalar_t* w = param + (r % p) * q;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      int32_t slot = discard;
      if (j + k < q) {
        const acc_t x = scale * static_cast<acc_t>(outer_element(u, v[j + k]));
        const int32_t y_bin = hist2d_axis_bin(static_cast<acc_t>(w[j + k]), y_axis);
        slot = hist2d_slot(hist2d_axis_bin(x, x_axis), y_bin, y_axis.bins, discard);
      }
      histogram.add(slot);
    }
  }
  histogram.flush();
}

at::Tensor outer_hist2d_cuda(const at::Tensor& left, const at::Tensor& right,
                             const at::Tensor& param, int64_t xbins, int64_t ybins, double xlo,
                             double xhi, double ylo, double yhi, double scale) {
  OuterHist2dArgs args =
      outer_hist2d_args(left, right, param, xbins, ybins, xlo, xhi, ylo, yhi, scale);
  const c10::cuda::CUDAGuard guard(left.device());
  const int64_t p = args.left.size(1), q = args.right.size(1);
  const int64_t n_rows = args.left.numel();
  if (n_rows > 0 && q > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, left.scalar_type(), "outer_hist2d", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const Hist2dAxis<acc_t> x_axis = make_hist2d_axis<acc_t>(xbins, xlo, xhi);
      const Hist2dAxis<acc_t> y_axis = make_hist2d_axis<acc_t>(ybins, ylo, yhi);
      auto* counts = reinterpret_cast<unsigned long long*>(args.counts.data_ptr<int64_t>());
      const auto stream = current_stream();
      // Scalar loads of 4 neighbouring values per thread: a warp's loads span 128 contiguous
      // values, served by the same cache lines, and the row bookkeeping is amortised.
      constexpr int VEC = 4;
      const RowTileGrid grid = row_tile_grid(n_rows, q, VEC);
      const scalar_t* u = args.left.const_data_ptr<scalar_t>();
      const scalar_t* v = args.right.const_data_ptr<scalar_t>();
      const scalar_t* w = args.param.const_data_ptr<scalar_t>();
      launch_histogram(xbins * ybins, [&](auto shared, size_t shared_bytes, int copies) {
        outer_hist2d_kernel<scalar_t, VEC, decltype(shared)::value><<<grid.grid(), kThreads, shared_bytes, stream>>>(
            u, v, w, n_rows, p, q, grid.rows_per_group, x_axis, y_axis, static_cast<acc_t>(scale), copies, counts);
      });
    });
  }
  return counts_as_float(args.counts);
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("outer_hist2d", &outer_hist2d_cuda); }

}  // namespace cockpit_fast
