// CUDA kernel of batch_dot. A block owns a tile of columns and a group of rows; every thread
// holds its VEC direction values in registers and reuses them for every row; each product is
// (scale * g) * direction, as the op reads. Per row, a warp reduces its products into one
// partial; torch sums the partials in a fixed order.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "cockpit_fast/cuda_common.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

template <typename scalar_t, int VEC>
__global__ void batch_dot_kernel(const scalar_t* __restrict__ data,
                                 const scalar_t* __restrict__ direction, int64_t n_rows,
                                 int64_t n_cols, int64_t rows_per_group,
                                 at::opmath_type<scalar_t> s,
                                 at::opmath_type<scalar_t>* __restrict__ row_partials) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t j = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  const int64_t partials_per_row = static_cast<int64_t>(gridDim.x) * kWarps;
  const int64_t warp_partial = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  acc_t d[VEC];
#pragma unroll
  for (int k = 0; k < VEC; ++k) d[k] = j + k < n_cols ? static_cast<acc_t>(direction[j + k]) : acc_t(0);

  const int64_t n_begin = static_cast<int64_t>(blockIdx.y) * rows_per_group;
  const int64_t n_end = min(n_rows, n_begin + rows_per_group);
  for (int64_t n = n_begin; n < n_end; ++n) {  // uniform per block: every lane reaches warp_sum
    const scalar_t* row = data + n * n_cols;
    acc_t dot = 0;
    if (VEC > 1 && j + VEC <= n_cols) {
      const Pack<scalar_t, VEC> pack = *reinterpret_cast<const Pack<scalar_t, VEC>*>(row + j);
#pragma unroll
      for (int k = 0; k < VEC; ++k) dot += (s * static_cast<acc_t>(pack.v[k])) * d[k];
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) {
        if (j + k < n_cols) dot += (s * static_cast<acc_t>(row[j + k])) * d[k];
      }
    }
    dot = warp_sum(dot);
    if (threadIdx.x % kWarpSize == 0) row_partials[n * partials_per_row + warp_partial] = dot;
  }
}

at::Tensor batch_dot_cuda(const at::Tensor& g, const at::Tensor& direction, double scale) {
  BatchDotArgs args = batch_dot_args(g, direction, scale);
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t n_rows = args.rows.size(0), n_cols = args.rows.size(1);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "batch_dot", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* data = args.rows.const_data_ptr<scalar_t>();
      with_vector_width<scalar_t>(vector_width<scalar_t>(data, n_cols), [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        const RowTileGrid grid = row_tile_grid(n_rows, n_cols, VEC);
        at::Tensor row_partials = at::empty({n_rows, grid.n_tiles * kWarps}, args.dots.options());
        batch_dot_kernel<scalar_t, VEC>
            <<<grid.grid(), kThreads, 0, current_stream()>>>(
                data, args.direction.const_data_ptr<scalar_t>(), n_rows, n_cols,
                grid.rows_per_group, static_cast<acc_t>(scale), row_partials.data_ptr<acc_t>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        at::sum_out(args.dots, row_partials, {1});
      });
    });
  }
  return args.dots;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("batch_dot", &batch_dot_cuda); }

}  // namespace cockpit_fast
