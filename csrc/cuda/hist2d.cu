// CUDA kernel of hist2d. A block owns a tile of columns and a group of rows; each thread owns
// VEC columns, bins their parameter values once into registers, then walks the rows binning
// scale * g[n, j]. The parameter is never expanded over N. Counts go to privatised
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
__global__ void hist2d_kernel(const scalar_t* __restrict__ data, const scalar_t* __restrict__ param,
                              int64_t n_rows, int64_t n_cols, int64_t rows_per_group,
                              Hist2dAxis<at::opmath_type<scalar_t>> x_axis,
                              Hist2dAxis<at::opmath_type<scalar_t>> y_axis,
                              at::opmath_type<scalar_t> scale, int copies,
                              unsigned long long* __restrict__ counts) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned int shared_counts[];
  const int32_t discard = x_axis.bins * y_axis.bins;  // slot of pairs that are not counted
  BlockHistogram<kShared> histogram(shared_counts, discard, copies, counts);
  const int64_t j = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  int32_t y_bin[VEC];  // -1: column out of range or parameter NaN
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    y_bin[k] = j + k < n_cols ? hist2d_axis_bin(static_cast<acc_t>(param[j + k]), y_axis) : -1;
  }

  const int64_t n_begin = static_cast<int64_t>(blockIdx.y) * rows_per_group;
  const int64_t n_end = min(n_rows, n_begin + rows_per_group);
  for (int64_t n = n_begin; n < n_end; ++n) {  // uniform per block: every lane counts together
    scalar_t values[VEC];
    load_values(data + n * n_cols, j, n_cols, values);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const int32_t x_bin = hist2d_axis_bin(scale * static_cast<acc_t>(values[k]), x_axis);
      histogram.add(hist2d_slot(x_bin, y_bin[k], y_axis.bins, discard));
    }
  }
  histogram.flush();
}

at::Tensor hist2d_cuda(const at::Tensor& g, const at::Tensor& param, int64_t xbins, int64_t ybins,
                       double xlo, double xhi, double ylo, double yhi, double scale) {
  Hist2dArgs args = hist2d_args(g, param, xbins, ybins, xlo, xhi, ylo, yhi, scale);
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t n_rows = args.rows.size(0), n_cols = args.rows.size(1);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "hist2d", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* data = args.rows.const_data_ptr<scalar_t>();
      const scalar_t* p = args.param.const_data_ptr<scalar_t>();
      const Hist2dAxis<acc_t> x_axis = make_hist2d_axis<acc_t>(xbins, xlo, xhi);
      const Hist2dAxis<acc_t> y_axis = make_hist2d_axis<acc_t>(ybins, ylo, yhi);
      auto* counts = reinterpret_cast<unsigned long long*>(args.counts.data_ptr<int64_t>());
      const auto stream = current_stream();
      // param is read once per block, value by value: only g's layout sets the vector width.
      with_vector_width<scalar_t>(vector_width<scalar_t>(data, n_cols), [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        const RowTileGrid grid = row_tile_grid(n_rows, n_cols, VEC);
        launch_histogram(xbins * ybins, [&](auto shared, size_t shared_bytes, int copies) {
          hist2d_kernel<scalar_t, VEC, decltype(shared)::value><<<grid.grid(), kThreads, shared_bytes, stream>>>(
              data, p, n_rows, n_cols, grid.rows_per_group, x_axis, y_axis, static_cast<acc_t>(scale), copies,
              counts);
        });
      });
    });
  }
  return counts_as_float(args.counts);
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("hist2d", &hist2d_cuda); }

}  // namespace cockpit_fast
