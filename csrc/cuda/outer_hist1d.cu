// CUDA kernel of outer_hist1d. The per-sample outer products form a virtual (N * p, q) matrix:
// row r = n * p + i holds left[n, i] * right[n, j]. The row-tile histogram skeleton
// (cuda_histogram.cuh) walks it; each thread forms its VEC products per row in registers
// (vector loads of right). No product is ever written to memory.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include "cockpit_fast/cuda_histogram.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

template <typename scalar_t, int VEC>
struct OuterHist1dSlots {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr int kVec = VEC;
  const scalar_t* left;
  const scalar_t* right;
  int64_t p, q;
  Hist1dBins<acc_t> bins;
  acc_t scale;

  struct Column {
    int64_t j;
  };

  __device__ __forceinline__ Column column(int64_t j) const { return {j}; }

  __device__ __forceinline__ void slots(const Column& c, int64_t r, int32_t (&out)[VEC]) const {
    const scalar_t u = left[r];
    scalar_t values[VEC];
    load_values(right + (r / p) * q, c.j, q, values);
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
      const acc_t x = scale * static_cast<acc_t>(outer_element(u, values[k]));
      out[k] = c.j + k < q ? hist1d_slot(x, bins) : bins.bins;
    }
  }
};

at::Tensor outer_hist1d_cuda(const at::Tensor& left, const at::Tensor& right, int64_t bins,
                             double lo, double hi, double scale) {
  OuterHist1dArgs args = outer_hist1d_args(left, right, bins, lo, hi, scale);
  const int64_t p = args.left.size(1), q = args.right.size(1);
  const int64_t n_rows = args.left.numel();
  if (n_rows > 0 && q > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, left.scalar_type(), "outer_hist1d", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const scalar_t* u = args.left.const_data_ptr<scalar_t>();
      const scalar_t* v = args.right.const_data_ptr<scalar_t>();
      const Hist1dBins<acc_t> b = make_hist1d_bins<acc_t>(bins, lo, hi);
      with_vector_width<scalar_t>(vector_width<scalar_t>(v, q), [&](auto vec) {
        const OuterHist1dSlots<scalar_t, decltype(vec)::value> op{u, v, p, q, b, static_cast<acc_t>(scale)};
        count_row_tiles(op, n_rows, q, args.counts);
      });
    });
  }
  return args.counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("outer_hist1d", &outer_hist1d_cuda); }

}  // namespace cockpit_fast
