// CUDA kernel of hist1d_batch_l2_batch_dots: the row-tile histogram skeleton (cuda_histogram.cuh)
// with a pass that, besides counting each value's hist1d slot, sums the squares of scale * g and
// its products with each direction. A block owns a tile of columns and a group of rows; a thread
// loads VEC values of a row once and uses them for all three. Per row, a warp reduces its squares
// and each direction's products into one partial each; torch sums the partials in a fixed order.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <tuple>

#include "cockpit_fast/cuda_histogram.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

// A pass of histogram_kernel (cuda_histogram.cuh's contract: count(histogram), every lane of a
// warp making every add together).
template <typename scalar_t, int VEC>
struct Hist1dBatchL2BatchDotsPass {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* data;        // (n_rows, n_cols)
  const scalar_t* directions;  // (k, n_cols)
  int64_t n_rows, n_cols, k, rows_per_group;
  Hist1dBins<acc_t> bins;
  acc_t hist_scale, scale;
  acc_t* square_partials;  // (n_rows, partials_per_row)
  acc_t* dot_partials;     // (n_rows, k, partials_per_row)

  template <typename Histogram>
  __device__ __forceinline__ void count(Histogram& histogram) const {
    const int64_t j = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
    const int64_t partials_per_row = static_cast<int64_t>(gridDim.x) * kWarps;
    const int64_t warp_partial = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
    const bool leader = threadIdx.x % kWarpSize == 0;
    const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_group;
    const int64_t r_end = min(n_rows, r_begin + rows_per_group);
    for (int64_t r = r_begin; r < r_end; ++r) {  // uniform per block: every lane reaches each add and warp_sum
      scalar_t raw[VEC];
      load_values(data + r * n_cols, j, n_cols, raw);  // 0 past the row's end
      acc_t v[VEC];
      acc_t square = 0;
#pragma unroll
      for (int c = 0; c < VEC; ++c) {
        const acc_t value = static_cast<acc_t>(raw[c]);
        histogram.add(j + c < n_cols ? hist1d_slot(hist_scale * value, bins) : bins.bins);
        v[c] = scale * value;
        square += v[c] * v[c];
      }
      square = warp_sum(square);
      if (leader) square_partials[r * partials_per_row + warp_partial] = square;
      for (int64_t i = 0; i < k; ++i) {
        scalar_t d[VEC];
        load_values(directions + i * n_cols, j, n_cols, d);
        acc_t dot = 0;
#pragma unroll
        for (int c = 0; c < VEC; ++c) dot += v[c] * static_cast<acc_t>(d[c]);
        dot = warp_sum(dot);
        if (leader) dot_partials[(r * k + i) * partials_per_row + warp_partial] = dot;
      }
    }
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> hist1d_batch_l2_batch_dots_cuda(
    const at::Tensor& g, const at::Tensor& directions, int64_t bins, double lo, double hi,
    double hist_scale, double scale) {
  Hist1dBatchL2BatchDotsArgs args =
      hist1d_batch_l2_batch_dots_args(g, directions, bins, lo, hi, hist_scale, scale);
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t n_rows = args.rows.size(0), n_cols = args.rows.size(1);
  const int64_t k = args.directions.size(0);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "hist1d_batch_l2_batch_dots", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* data = args.rows.const_data_ptr<scalar_t>();
      const scalar_t* dirs = args.directions.const_data_ptr<scalar_t>();
      // Vector loads only where every row of g and of the directions keeps their alignment.
      int width = vector_width<scalar_t>(data, n_cols);
      if (k > 0 && vector_width<scalar_t>(dirs, n_cols) != width) width = 1;
      with_vector_width<scalar_t>(width, [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        const RowTileGrid grid = row_tile_grid(n_rows, n_cols, VEC);
        const int64_t partials_per_row = grid.n_tiles * kWarps;
        at::Tensor square_partials = at::empty({n_rows, partials_per_row}, args.l2.options());
        at::Tensor dot_partials = at::empty({n_rows, k, partials_per_row}, args.l2.options());
        const Hist1dBatchL2BatchDotsPass<scalar_t, VEC> pass{
            data, dirs, n_rows, n_cols, k, grid.rows_per_group, make_hist1d_bins<acc_t>(bins, lo, hi),
            static_cast<acc_t>(hist_scale), static_cast<acc_t>(scale),
            square_partials.data_ptr<acc_t>(), dot_partials.data_ptr<acc_t>()};
        launch_histogram(pass, grid.grid(), args.counts);  // checks the launch
        at::sum_out(args.l2, square_partials, {1});
        if (k > 0) at::sum_out(args.dots, dot_partials, {2});
      });
    });
  }
  return {args.counts, args.l2, args.dots};
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) {
  m.impl("hist1d_batch_l2_batch_dots", &hist1d_batch_l2_batch_dots_cuda);
}

}  // namespace cockpit_fast
