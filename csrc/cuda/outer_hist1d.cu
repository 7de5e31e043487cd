// CUDA kernel of outer_hist1d. The per-sample outer products form a virtual (N * p, q) matrix:
// row r = n * p + i holds left[n, i] * right[n, j]. A block owns a tile of columns and a group
// of rows; each thread forms its VEC products per row in registers (vector loads of right) and
// counts their bins into privatised shared-memory histograms (one copy per warp where they fit,
// warp-aggregated atomics within). No product is ever written to memory.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "cockpit_fast/cuda_common.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

template <typename scalar_t, int VEC, bool kShared>
__global__ void outer_hist1d_kernel(const scalar_t* __restrict__ left,
                                    const scalar_t* __restrict__ right, int64_t n_rows, int64_t p,
                                    int64_t q, int64_t rows_per_group,
                                    Hist1dBins<at::opmath_type<scalar_t>> bins,
                                    at::opmath_type<scalar_t> scale, int copies,
                                    unsigned long long* __restrict__ counts) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned int shared_counts[];
  BlockHistogram<kShared> histogram(shared_counts, bins.bins, copies, counts);
  const int64_t j = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_group;
  const int64_t r_end = min(n_rows, r_begin + rows_per_group);
  for (int64_t r = r_begin; r < r_end; ++r) {  // uniform per block: every lane counts together
    const scalar_t u = left[r];
    scalar_t values[VEC];
    load_values(right + (r / p) * q, j, q, values);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t x = scale * static_cast<acc_t>(outer_element(u, values[k]));
      histogram.add(j + k < q ? hist1d_slot(x, bins) : bins.bins);
    }
  }
  histogram.flush();
}

at::Tensor outer_hist1d_cuda(const at::Tensor& left, const at::Tensor& right, int64_t bins,
                             double lo, double hi, double scale) {
  OuterHist1dArgs args = outer_hist1d_args(left, right, bins, lo, hi, scale);
  const c10::cuda::CUDAGuard guard(left.device());
  const int64_t p = args.left.size(1), q = args.right.size(1);
  const int64_t n_rows = args.left.numel();
  if (n_rows > 0 && q > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, left.scalar_type(), "outer_hist1d", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* u = args.left.const_data_ptr<scalar_t>();
      const scalar_t* v = args.right.const_data_ptr<scalar_t>();
      const Hist1dBins<acc_t> b = make_hist1d_bins<acc_t>(bins, lo, hi);
      auto* counts = reinterpret_cast<unsigned long long*>(args.counts.data_ptr<int64_t>());
      const auto stream = current_stream();
      with_vector_width<scalar_t>(vector_width<scalar_t>(v, q), [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        const RowTileGrid grid = row_tile_grid(n_rows, q, VEC);
        launch_histogram(bins, [&](auto shared, size_t shared_bytes, int copies) {
          outer_hist1d_kernel<scalar_t, VEC, decltype(shared)::value>
              <<<grid.grid(), kThreads, shared_bytes, stream>>>(u, v, n_rows, p, q, grid.rows_per_group, b,
                                                              static_cast<acc_t>(scale), copies, counts);
        });
      });
    });
  }
  return counts_as_float(args.counts);
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("outer_hist1d", &outer_hist1d_cuda); }

}  // namespace cockpit_fast
