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
  const int64_t slots = bins.bins + 1;  // the last slot takes NaN and out-of-range lanes
  unsigned int* warp_counts = shared_counts + (threadIdx.x / kWarpSize % copies) * slots;
  if constexpr (kShared) {
    for (int64_t i = threadIdx.x; i < slots * copies; i += blockDim.x) shared_counts[i] = 0;
    __syncthreads();
  }

  const int64_t j = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) * VEC;
  const int64_t r_begin = static_cast<int64_t>(blockIdx.y) * rows_per_group;
  const int64_t r_end = min(n_rows, r_begin + rows_per_group);
  for (int64_t r = r_begin; r < r_end; ++r) {  // uniform per block: every lane counts together
    const scalar_t u = left[r];
    const scalar_t* v = right + (r / p) * q;
    scalar_t values[VEC];
    if (VEC > 1 && j + VEC <= q) {
      const Pack<scalar_t, VEC> pack = *reinterpret_cast<const Pack<scalar_t, VEC>*>(v + j);
#pragma unroll
      for (int k = 0; k < VEC; ++k) values[k] = pack.v[k];
    } else {
#pragma unroll
      for (int k = 0; k < VEC; ++k) values[k] = j + k < q ? v[j + k] : scalar_t(0);
    }
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t x = scale * static_cast<acc_t>(outer_element(u, values[k]));
      const int32_t slot = j + k < q ? hist1d_slot(x, bins) : bins.bins;
      if constexpr (kShared) {
        count_in_warp(warp_counts, static_cast<unsigned int>(slot));
      } else if (slot < bins.bins) {
        atomicAdd(counts + slot, 1ULL);
      }
    }
  }

  if constexpr (kShared) {
    __syncthreads();
    for (int64_t b = threadIdx.x; b < bins.bins; b += blockDim.x) {
      unsigned long long total = 0;
      for (int c = 0; c < copies; ++c) total += shared_counts[c * slots + b];
      if (total > 0) atomicAdd(counts + b, total);
    }
  }
}

at::Tensor outer_hist1d_cuda(const at::Tensor& left, const at::Tensor& right, int64_t bins,
                             double lo, double hi, double scale) {
  const c10::cuda::CUDAGuard guard(left.device());
  OuterHist1dArgs args = outer_hist1d_args(left, right, bins, lo, hi, scale);
  const int64_t p = args.left.size(1), q = args.right.size(1);
  const int64_t n_rows = args.left.numel();
  if (n_rows > 0 && q > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, left.scalar_type(), "outer_hist1d", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* u = args.left.const_data_ptr<scalar_t>();
      const scalar_t* v = args.right.const_data_ptr<scalar_t>();
      const Hist1dBins<acc_t> b = make_hist1d_bins<acc_t>(bins, lo, hi);
      auto* counts = reinterpret_cast<unsigned long long*>(args.counts.data_ptr<int64_t>());
      const int copies = shared_histogram_copies(bins + 1);
      const auto stream = current_stream();
      with_vector_width<scalar_t>(vector_width<scalar_t>(v, q), [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        const RowTileGrid grid = row_tile_grid(n_rows, q, VEC);
        if (copies > 0) {
          const size_t shared_bytes = sizeof(unsigned int) * (bins + 1) * copies;
          outer_hist1d_kernel<scalar_t, VEC, true><<<grid.grid(), kThreads, shared_bytes, stream>>>(
              u, v, n_rows, p, q, grid.rows_per_group, b, static_cast<acc_t>(scale), copies, counts);
        } else {
          outer_hist1d_kernel<scalar_t, VEC, false><<<grid.grid(), kThreads, 0, stream>>>(
              u, v, n_rows, p, q, grid.rows_per_group, b, static_cast<acc_t>(scale), 1, counts);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  }
  return counts_as_float(args.counts);
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("outer_hist1d", &outer_hist1d_cuda); }

}  // namespace cockpit_fast
