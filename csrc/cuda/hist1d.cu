// CUDA kernel of hist1d: the flat histogram skeleton (cuda_histogram.cuh) over g, read with
// vector loads; each value is scaled, clamped and binned.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "cockpit_fast/cuda_histogram.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

template <typename scalar_t, int VEC>
struct Hist1dSlots {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr int kVec = VEC;
  const scalar_t* data;
  Hist1dBins<acc_t> bins;
  acc_t scale;

  __device__ __forceinline__ void slots(int64_t i, int64_t numel, int32_t (&out)[VEC]) const {
    scalar_t values[VEC];
    load_values(data, i, numel, values);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      out[k] = i + k < numel ? hist1d_slot(scale * static_cast<acc_t>(values[k]), bins) : bins.bins;
    }
  }
};

at::Tensor hist1d_cuda(const at::Tensor& g, int64_t bins, double lo, double hi, double scale) {
  Hist1dArgs args = hist1d_args(g, bins, lo, hi, scale);
  const int64_t numel = args.rows.numel();
  if (numel > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "hist1d", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* data = args.rows.const_data_ptr<scalar_t>();
      const Hist1dBins<acc_t> b = make_hist1d_bins<acc_t>(bins, lo, hi);
      // One flat run: only the base pointer's alignment decides the vector width.
      with_vector_width<scalar_t>(vector_width<scalar_t>(data, 0), [&](auto vec) {
        const Hist1dSlots<scalar_t, decltype(vec)::value> op{data, b, static_cast<acc_t>(scale)};
        count_flat(op, numel, args.counts);
      });
    });
  }
  return args.counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("hist1d", &hist1d_cuda); }

}  // namespace cockpit_fast
