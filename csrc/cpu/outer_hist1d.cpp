// CPU kernel of outer_hist1d: the histogram of every per-sample outer product
// scale * left[n] right[n]^T, without forming it.
//
// For a finite, nonzero factor u and scale, the bin of scale * (u * v) is monotone in v: every
// step (the rounded product, the cast, the scaling, the clamp, the bin rule) is monotone. So
// with one sample's longer factor sorted, a row's bins form runs, and each run is measured with
// a galloping search: a row costs O(runs * log q) instead of O(q). Gradients sit in few bins,
// so runs are few. The bins are those of the very products the materialised op sees, so the
// counts are the same, exactly. A zero factor (a ReLU unit that was off: often half the rows)
// puts every finite value in the bin of 0 at once (0 * ±inf is NaN, never counted). Rows with a
// non-finite factor are binned one by one, and so is every row when there are too few rows to
// pay for the sort.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cockpit_fast/entry.h"
#include "parallel.h"
#include "private_histograms.h"

namespace cockpit_fast {
namespace {

template <typename scalar_t>
struct RowCounter {
  using acc_t = at::opmath_type<scalar_t>;
  Hist1dBins<acc_t> bins;
  acc_t scale;

  int32_t slot(scalar_t u, scalar_t v) const {
    return hist1d_slot(scale * static_cast<acc_t>(outer_element(u, v)), bins);
  }

  // Whether the bins of u * v are monotone in v (else products may be NaN).
  bool monotone(scalar_t u) const {
    const acc_t u_acc = static_cast<acc_t>(u);
    return std::isfinite(u_acc) && u_acc != 0 && scale != 0;
  }

  // Adds the bins of u * values[j], j < len, one by one (NaN goes to the discard slot).
  void count_each(scalar_t u, const scalar_t* values, int64_t len, int64_t* counts) const {
    for (int64_t j = 0; j < len; ++j) ++counts[slot(u, values[j])];
  }

  // For u == 0: the `finite` finite values among them all land in the bin of ±0.
  void count_zero_row(int64_t finite, int64_t* counts) const {
    counts[slot(scalar_t(0), scalar_t(0))] += finite;
  }

  // The same as count_each for ascending, NaN-free values: run by run when u allows.
  void count_sorted(scalar_t u, const scalar_t* sorted, int64_t len, int64_t* counts) const {
    if (!monotone(u)) return count_each(u, sorted, len, counts);
    int64_t start = 0;
    while (start < len) {
      const int32_t bin = slot(u, sorted[start]);
      // Gallop past the run of `bin`, then bisect: slot(inside) == bin, slot(outside) != bin.
      int64_t inside = start, outside = start + 1, step = 1;
      while (outside < len && slot(u, sorted[outside]) == bin) {
        inside = outside;
        step *= 2;
        outside = std::min(len, inside + step);
      }
      while (outside - inside > 1) {
        const int64_t middle = inside + (outside - inside) / 2;
        (slot(u, sorted[middle]) == bin ? inside : outside) = middle;
      }
      counts[bin] += outside - start;
      start = outside;
    }
  }
};

// Sorting a sample's q values costs about as much as binning log2(q) rows directly.
inline bool sorting_pays(int64_t rows, int64_t q) {
  int64_t log2_q = 0;
  while ((int64_t(1) << log2_q) < q) ++log2_q;
  return rows > 2 * log2_q;
}

template <typename scalar_t>
void outer_hist1d_kernel(const at::Tensor& left, const at::Tensor& right, int64_t bins,
                         double lo, double hi, double scale, at::Tensor& counts) {
  using acc_t = at::opmath_type<scalar_t>;
  // u * v == v * u, so the shorter factor gives the rows and the longer one is sorted.
  const bool swap = left.size(1) > right.size(1);
  const at::Tensor& row_factor = swap ? right : left;
  const at::Tensor& sorted_factor = swap ? left : right;
  const int64_t n = left.size(0), p = row_factor.size(1), q = sorted_factor.size(1);
  const scalar_t* rows = row_factor.const_data_ptr<scalar_t>();
  const scalar_t* columns = sorted_factor.const_data_ptr<scalar_t>();
  const RowCounter<scalar_t> counter{make_hist1d_bins<acc_t>(bins, lo, hi), static_cast<acc_t>(scale)};
  const bool sort = sorting_pays(p, q);
  PrivateHistograms histograms(bins + 1);  // + the discard slot for NaN

  at::parallel_for(0, n, grain_for(p * q), [&](int64_t begin, int64_t end) {
    int64_t* mine = histograms.mine();
    std::vector<scalar_t> sorted(sort ? q : 0);
    for (int64_t sample = begin; sample < end; ++sample) {
      const scalar_t* u = rows + sample * p;
      const scalar_t* v = columns + sample * q;
      const int64_t finite = std::count_if(v, v + q, [](scalar_t x) {
        return std::isfinite(static_cast<acc_t>(x));
      });
      if (!sort) {
        for (int64_t i = 0; i < p; ++i) {
          if (static_cast<acc_t>(u[i]) == 0) {
            counter.count_zero_row(finite, mine);
          } else {
            counter.count_each(u[i], v, q, mine);
          }
        }
        continue;
      }
      // NaN times anything is NaN and never counted: leave those values out.
      const int64_t len = std::copy_if(v, v + q, sorted.begin(), [](scalar_t x) {
                            return !is_nan(static_cast<acc_t>(x));
                          }) - sorted.begin();
      std::sort(sorted.begin(), sorted.begin() + len, [](scalar_t x, scalar_t y) {
        return static_cast<acc_t>(x) < static_cast<acc_t>(y);
      });
      for (int64_t i = 0; i < p; ++i) {
        if (static_cast<acc_t>(u[i]) == 0) {
          counter.count_zero_row(finite, mine);
        } else {
          counter.count_sorted(u[i], sorted.data(), len, mine);
        }
      }
    }
  });
  histograms.sum_into(counts.data_ptr<int64_t>(), bins);
}

at::Tensor outer_hist1d_cpu(const at::Tensor& left, const at::Tensor& right, int64_t bins,
                            double lo, double hi, double scale) {
  OuterHist1dArgs args = outer_hist1d_args(left, right, bins, lo, hi, scale);
  if (args.left.numel() > 0 && args.right.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, left.scalar_type(), "outer_hist1d", [&] {
      outer_hist1d_kernel<scalar_t>(args.left, args.right, bins, lo, hi, scale, args.counts);
    });
  }
  return counts_as_float(args.counts);
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) { m.impl("outer_hist1d", &outer_hist1d_cpu); }

}  // namespace cockpit_fast
