// CPU kernel of hist1d: scale, clamp and bin in one pass, no intermediate tensor.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>

#include "cockpit_fast/entry.h"
#include "parallel.h"
#include "private_histograms.h"
#include "simd.h"

namespace cockpit_fast {
namespace {

template <typename scalar_t>
void hist1d_kernel(const at::Tensor& rows, int64_t bins, double lo, double hi, double scale,
                   at::Tensor& counts) {
  using acc_t = at::opmath_type<scalar_t>;
  const Hist1dBins<acc_t> b = make_hist1d_bins<acc_t>(bins, lo, hi);
  const acc_t s = static_cast<acc_t>(scale);
  const scalar_t* data = rows.const_data_ptr<scalar_t>();

  count_histogram(counts, rows.numel(), kValuesPerTask, [&](int64_t begin, int64_t end, SlotCounter& counter) {
    int32_t* slots = counter.slots();
    for (int64_t base = begin; base < end; base += kSlotBatch) {
      const int64_t len = std::min(kSlotBatch, end - base);
      if (b.inverse_span != acc_t(0)) {
        hist1d_slots<true>(data + base, len, s, b, slots);
      } else {
        hist1d_slots<false>(data + base, len, s, b, slots);
      }
      const int64_t next = base + len;
      const int64_t next_len = std::min(kSlotBatch, end - next);
      counter.count(len, {data + next, next_len * int64_t(sizeof(scalar_t))});
    }
  });
}

at::Tensor hist1d_cpu(const at::Tensor& g, int64_t bins, double lo, double hi, double scale) {
  Hist1dArgs args = hist1d_args(g, bins, lo, hi, scale);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "hist1d", [&] {
      hist1d_kernel<scalar_t>(args.rows, bins, lo, hi, scale, args.counts);
    });
  }
  return args.counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) { m.impl("hist1d", &hist1d_cpu); }

}  // namespace cockpit_fast
