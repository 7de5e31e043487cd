// CPU kernel of hist2d: bins (scale * g[n, j], param[j]) pairs without expanding param over N.
// The parameter's bin is computed once per column, then reused for every sample.
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

constexpr int64_t kGroupRows = 16;

template <typename scalar_t>
void hist2d_kernel(const at::Tensor& rows, const at::Tensor& param, int64_t xbins, int64_t ybins,
                   double xlo, double xhi, double ylo, double yhi, double scale,
                   at::Tensor& counts) {
  using acc_t = at::opmath_type<scalar_t>;
  const Hist2dAxis<acc_t> x_axis = make_hist2d_axis<acc_t>(xbins, xlo, xhi);
  const Hist2dAxis<acc_t> y_axis = make_hist2d_axis<acc_t>(ybins, ylo, yhi);
  const int64_t n_rows = rows.size(0), n_cols = rows.size(1);
  const int32_t discard = static_cast<int32_t>(xbins * ybins);  // slot of uncounted pairs
  const acc_t s = static_cast<acc_t>(scale);
  const scalar_t* data = rows.const_data_ptr<scalar_t>();
  const std::vector<int32_t> column_bin = axis_bins(param.const_data_ptr<scalar_t>(), n_cols, y_axis);

  // A block is a tile of kSlotBatch columns over a group of rows.
  const int64_t n_tiles = (n_cols + kSlotBatch - 1) / kSlotBatch;
  const int64_t n_groups = (n_rows + kGroupRows - 1) / kGroupRows;
  const int64_t values_per_block = std::min(n_rows, kGroupRows) * std::min(n_cols, kSlotBatch);
  count_histogram(counts, n_groups * n_tiles, grain_for(values_per_block),
                  [&](int64_t begin, int64_t end, SlotCounter& counter) {
    int32_t* slots = counter.slots();
    for (int64_t block = begin; block < end; ++block) {
      const int64_t group = block / n_tiles, tile = block % n_tiles;
      const int64_t j0 = tile * kSlotBatch, len = std::min(kSlotBatch, n_cols - j0);
      const int32_t* y_bins = column_bin.data() + j0;
      const int64_t n_end = std::min(n_rows, (group + 1) * kGroupRows);
      for (int64_t n = group * kGroupRows; n < n_end; ++n) {
        hist2d_slots(data + n * n_cols + j0, y_bins, len, s, x_axis, y_axis.bins, discard, slots);
        // Next: the same columns of the next row (valid memory even past this group).
        const Upcoming next = n + 1 < n_rows
                                  ? Upcoming{data + (n + 1) * n_cols + j0, len * int64_t(sizeof(scalar_t))}
                                  : Upcoming{};
        counter.count(len, next);
      }
    }
  });
}

at::Tensor hist2d_cpu(const at::Tensor& g, const at::Tensor& param, int64_t xbins, int64_t ybins,
                      double xlo, double xhi, double ylo, double yhi, double scale) {
  Hist2dArgs args = hist2d_args(g, param, xbins, ybins, xlo, xhi, ylo, yhi, scale);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "hist2d", [&] {
      hist2d_kernel<scalar_t>(args.rows, args.param, xbins, ybins, xlo, xhi, ylo, yhi, scale,
                              args.counts);
    });
  }
  return args.counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) { m.impl("hist2d", &hist2d_cpu); }

}  // namespace cockpit_fast
