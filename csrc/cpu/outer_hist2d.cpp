// CPU kernel of outer_hist2d: bins the pairs (scale * left[n, i] * right[n, j], param[i, j])
// without forming the per-sample outer products. The parameter's bins are computed once for
// all samples; tasks bin blocks of rows for groups of samples into private histograms.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cockpit_fast/entry.h"
#include "parallel.h"
#include "private_histograms.h"
#include "simd.h"

namespace cockpit_fast {
namespace {

constexpr int64_t kBlockValues = 16384;  // parameter bins (int32) one task keeps hot: 64 KiB
constexpr int64_t kGroupSamples = 16;

template <typename scalar_t>
void outer_hist2d_kernel(const at::Tensor& left, const at::Tensor& right, const at::Tensor& param,
                         int64_t xbins, int64_t ybins, double xlo, double xhi, double ylo,
                         double yhi, double scale, at::Tensor& counts) {
  using acc_t = at::opmath_type<scalar_t>;
  const Hist2dAxis<acc_t> x_axis = make_hist2d_axis<acc_t>(xbins, xlo, xhi);
  const Hist2dAxis<acc_t> y_axis = make_hist2d_axis<acc_t>(ybins, ylo, yhi);
  const int64_t n = left.size(0), p = left.size(1), q = right.size(1);
  const int32_t discard = static_cast<int32_t>(xbins * ybins);  // slot of uncounted pairs
  const acc_t s = static_cast<acc_t>(scale);
  const scalar_t* u = left.const_data_ptr<scalar_t>();
  const scalar_t* v = right.const_data_ptr<scalar_t>();
  const std::vector<int32_t> param_bin = axis_bins(param.const_data_ptr<scalar_t>(), p * q, y_axis);

  // A task bins a block of rows i for a group of samples: the block's parameter bins stay in
  // cache while every sample of the group passes over them.
  const int64_t rows_per_block = std::max<int64_t>(1, kBlockValues / std::max<int64_t>(1, q));
  const int64_t n_blocks = (p + rows_per_block - 1) / rows_per_block;
  const int64_t n_groups = (n + kGroupSamples - 1) / kGroupSamples;
  const int64_t values_per_task = std::min(p, rows_per_block) * q * std::min(n, kGroupSamples);
  count_histogram(counts, n_blocks * n_groups, grain_for(values_per_task),
                  [&](int64_t begin, int64_t end, SlotCounter& counter) {
    int32_t* slots = counter.slots();
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task % n_blocks, group = task / n_blocks;
      const int64_t i_end = std::min(p, (block + 1) * rows_per_block);
      const int64_t sample_end = std::min(n, (group + 1) * kGroupSamples);
      for (int64_t sample = group * kGroupSamples; sample < sample_end; ++sample) {
        const scalar_t* v_row = v + sample * q;
        for (int64_t i = block * rows_per_block; i < i_end; ++i) {
          const scalar_t factor = u[sample * p + i];
          const int32_t* y_bins = param_bin.data() + i * q;
          for (int64_t j0 = 0; j0 < q; j0 += kSlotBatch) {
            const int64_t len = std::min(kSlotBatch, q - j0);
            outer_hist2d_slots(factor, v_row + j0, y_bins + j0, len, s, x_axis, y_axis.bins,
                               discard, slots);
            counter.count(len);
          }
        }
      }
    }
  });
}

at::Tensor outer_hist2d_cpu(const at::Tensor& left, const at::Tensor& right,
                            const at::Tensor& param, int64_t xbins, int64_t ybins, double xlo,
                            double xhi, double ylo, double yhi, double scale) {
  OuterHist2dArgs args =
      outer_hist2d_args(left, right, param, xbins, ybins, xlo, xhi, ylo, yhi, scale);
  if (args.left.numel() > 0 && args.right.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, left.scalar_type(), "outer_hist2d", [&] {
      outer_hist2d_kernel<scalar_t>(args.left, args.right, args.param, xbins, ybins, xlo, xhi,
                                    ylo, yhi, scale, args.counts);
    });
  }
  return args.counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) { m.impl("outer_hist2d", &outer_hist2d_cpu); }

}  // namespace cockpit_fast
