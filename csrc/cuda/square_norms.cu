// CUDA kernels of batch_l2, sum_grad_squared and batch_l2_and_sum_grad_squared.
//
// A block owns a tile of columns and walks a group of rows; every thread owns VEC consecutive
// columns and keeps their sums of squares in registers across rows. Per row, a warp reduces its
// squares and writes one partial (no block barrier per row). Partials are then summed by torch
// in a fixed order, so results are deterministic.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <tuple>

#include "cockpit_fast/cuda_common.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

template <typename scalar_t, int VEC, bool kRows, bool kColumns>
__global__ void square_norms_kernel(const scalar_t* __restrict__ data, int64_t n_rows,
                                    int64_t n_cols, int64_t rows_per_group,
                                    at::opmath_type<scalar_t> scale,
                                    at::opmath_type<scalar_t>* __restrict__ row_partials,
                                    at::opmath_type<scalar_t>* __restrict__ column_partials) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t j = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  const int64_t n_begin = static_cast<int64_t>(blockIdx.y) * rows_per_group;
  const int64_t n_end = min(n_rows, n_begin + rows_per_group);
  const int64_t partials_per_row = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t warp_partial = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  acc_t columns[VEC] = {};

  for (int64_t n = n_begin; n < n_end; ++n) {
    const scalar_t* row = data + n * n_cols;
    acc_t values[VEC];
    if (VEC > 1 && j + VEC <= n_cols) {
      const Pack<scalar_t, VEC> pack = *reinterpret_cast<const Pack<scalar_t, VEC>*>(row + j);
#pragma unroll
      for (int k = 0; k < VEC; ++k) values[k] = static_cast<acc_t>(pack.v[k]);
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) values[k] = j + k < n_cols ? static_cast<acc_t>(row[j + k]) : acc_t(0);
    }
    acc_t row_sum = 0;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t v = scale * values[k];
      row_sum += v * v;
      if constexpr (kColumns) columns[k] += v * v;
    }
    if constexpr (kRows) {
      row_sum = warp_sum(row_sum);  // all lanes reach this: the row loop is uniform per block
      if (threadIdx.x % kWarpSize == 0) row_partials[n * partials_per_row + warp_partial] = row_sum;
    }
  }
  if constexpr (kColumns) {
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      if (j + k < n_cols) column_partials[blockIdx.y * n_cols + j + k] = columns[k];
    }
  }
}

template <bool kRows, bool kColumns>
SquareNormsArgs square_norms_cuda(const char* op, const at::Tensor& g, double scale) {
  SquareNormsArgs args = square_norms_args(op, g, scale);
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t n_rows = args.rows.size(0), n_cols = args.rows.size(1);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "square_norms", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* data = args.rows.const_data_ptr<scalar_t>();
      with_vector_width<scalar_t>(vector_width<scalar_t>(data, n_cols), [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        const RowTileGrid grid = row_tile_grid(n_rows, n_cols, VEC);
        const auto options = args.l2.options();
        at::Tensor row_partials = at::empty({kRows ? n_rows : 0, grid.n_tiles * kWarps}, options);
        at::Tensor column_partials = at::empty({kColumns ? grid.n_groups : 0, n_cols}, options);
        square_norms_kernel<scalar_t, VEC, kRows, kColumns>
            <<<grid.grid(), kThreads, 0, current_stream()>>>(
                data, n_rows, n_cols, grid.rows_per_group, static_cast<acc_t>(scale),
                row_partials.data_ptr<acc_t>(), column_partials.data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if constexpr (kRows) at::sum_out(args.l2, row_partials, {1});
        if constexpr (kColumns) at::sum_out(args.sum_sq, column_partials, {0});
      });
    });
  }
  args.sum_sq = args.sum_sq.view(g.sizes().slice(1));
  return args;
}

at::Tensor batch_l2_cuda(const at::Tensor& g, double scale) {
  return square_norms_cuda<true, false>("batch_l2", g, scale).l2;
}

at::Tensor sum_grad_squared_cuda(const at::Tensor& g, double scale) {
  return square_norms_cuda<false, true>("sum_grad_squared", g, scale).sum_sq;
}

std::tuple<at::Tensor, at::Tensor> batch_l2_and_sum_grad_squared_cuda(const at::Tensor& g,
                                                                      double scale) {
  SquareNormsArgs args = square_norms_cuda<true, true>("batch_l2_and_sum_grad_squared", g, scale);
  return {args.l2, args.sum_sq};
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) {
  m.impl("batch_l2", &batch_l2_cuda);
  m.impl("sum_grad_squared", &sum_grad_squared_cuda);
  m.impl("batch_l2_and_sum_grad_squared", &batch_l2_and_sum_grad_squared_cuda);
}

}  // namespace cockpit_fast
