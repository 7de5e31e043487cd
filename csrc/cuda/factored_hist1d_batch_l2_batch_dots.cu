// CUDA kernel of factored_hist1d_batch_l2_batch_dots: the per-sample gradients G[n] = left[n]^T
// right[n] formed by one batched GEMM (cuBLAS) into device memory, then hist1d_batch_l2_batch_dots's
// CUDA kernel over them. On a GPU the formed chunk costs one write and one read at device
// bandwidth, which the CPU kernel's in-cache formation exists to avoid; the caller bounds the
// chunk (per_sample.grads.CHUNK_VALUES). Counts and sums are those of the formed route exactly.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using Outputs = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

Outputs factored_hist1d_batch_l2_batch_dots_cuda(const at::Tensor& left, const at::Tensor& right,
                                                 const at::Tensor& directions, int64_t bins,
                                                 double lo, double hi, double hist_scale,
                                                 double scale) {
  FactoredHist1dBatchL2BatchDotsArgs args = factored_hist1d_batch_l2_batch_dots_args(
      left, right, directions, bins, lo, hi, hist_scale, scale);
  const c10::cuda::CUDAGuard guard(left.device());
  // The factors may require grad: the product is formed below autograd, as the op's results are.
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  const at::Tensor formed = at::bmm(args.left.transpose(1, 2), args.right);
  static const auto fused =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("cockpit_fast::hist1d_batch_l2_batch_dots", "")
          .typed<Outputs(const at::Tensor&, const at::Tensor&, int64_t, double, double, double, double)>();
  return fused.call(formed, args.directions, bins, lo, hi, hist_scale, scale);
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) {
  m.impl("factored_hist1d_batch_l2_batch_dots", &factored_hist1d_batch_l2_batch_dots_cuda);
}

}  // namespace cockpit_fast
