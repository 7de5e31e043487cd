// CUDA kernel of hist1d: a grid-stride pass that scales, clamps and bins with vector loads into
// privatised shared-memory histograms (one copy per warp where they fit, warp-aggregated
// atomics within), flushed once per block into int64 global counts. Histograms too large for
// shared memory count straight into global memory.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "cockpit_fast/cuda_common.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

template <typename scalar_t, int VEC, bool kShared>
__global__ void hist1d_kernel(const scalar_t* __restrict__ data, int64_t numel,
                              Hist1dBins<at::opmath_type<scalar_t>> bins,
                              at::opmath_type<scalar_t> scale, int copies,
                              unsigned long long* __restrict__ counts) {
  using acc_t = at::opmath_type<scalar_t>;
  extern __shared__ unsigned int shared_counts[];
  BlockHistogram<kShared> histogram(shared_counts, bins.bins, copies, counts);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads * VEC;
  // `base` is the same for the whole block, so every lane runs every iteration (count_in_warp).
  for (int64_t base = static_cast<int64_t>(blockIdx.x) * kThreads * VEC; base < numel; base += stride) {
    const int64_t i = base + static_cast<int64_t>(threadIdx.x) * VEC;
    scalar_t values[VEC];
    load_values(data, i, numel, values);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      histogram.add(i + k < numel ? hist1d_slot(scale * static_cast<acc_t>(values[k]), bins) : bins.bins);
    }
  }
  histogram.flush();
}

at::Tensor hist1d_cuda(const at::Tensor& g, int64_t bins, double lo, double hi, double scale) {
  Hist1dArgs args = hist1d_args(g, bins, lo, hi, scale);
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t numel = args.rows.numel();
  if (numel > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "hist1d", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* data = args.rows.const_data_ptr<scalar_t>();
      const Hist1dBins<acc_t> b = make_hist1d_bins<acc_t>(bins, lo, hi);
      auto* counts = reinterpret_cast<unsigned long long*>(args.counts.data_ptr<int64_t>());
      const auto stream = current_stream();
      // One flat run: only the base pointer's alignment decides the vector width.
      with_vector_width<scalar_t>(vector_width<scalar_t>(data, 0), [&](auto vec) {
        constexpr int VEC = decltype(vec)::value;
        const unsigned int blocks = flat_blocks(numel, VEC);
        launch_histogram(bins, [&](auto shared, size_t shared_bytes, int copies) {
          hist1d_kernel<scalar_t, VEC, decltype(shared)::value><<<blocks, kThreads, shared_bytes, stream>>>(
              data, numel, b, static_cast<acc_t>(scale), copies, counts);
        });
      });
    });
  }
  return counts_as_float(args.counts);
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("hist1d", &hist1d_cuda); }

}  // namespace cockpit_fast
