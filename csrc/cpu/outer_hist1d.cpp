// CPU kernel of outer_hist1d: the histogram of every per-sample outer product
// scale * left[n] right[n]^T, without forming it.
//
// For a finite, nonzero factor u and scale, the bin of scale * (u * v) is monotone in v: every
// step (the rounded product, the cast, the scaling, the clamp, the bin rule) is monotone. So
// with one sample's longer factor sorted (radix sort), a row's bins form runs, and each run's
// end is found from the bin's threshold, computed once per call: a row costs O(bins it spans *
// log q) instead of O(q), and gradients span few bins. The comparisons are made on the very
// products the materialised op bins, so the counts are the same, exactly. A zero factor (a ReLU
// unit that was off: often half the rows) puts every finite value in the bin of 0 at once
// (0 * ±inf is NaN, never counted). Rows with a non-finite factor are binned one by one, and so
// is every row when there are too few rows to pay for the sort.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cockpit_fast/entry.h"
#include "parallel.h"
#include "private_histograms.h"
#include "simd.h"

namespace cockpit_fast {
namespace {

// Unsigned keys that order like the floats (sign bit flipped for positives, all bits for
// negatives; -0 before +0, which bin alike), and back.
template <typename T>
using KeyOf = std::conditional_t<sizeof(T) == 8, uint64_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint16_t>>;

template <typename T>
KeyOf<T> order_key(T v) {
  using Key = KeyOf<T>;
  constexpr Key kSign = Key(1) << (8 * sizeof(Key) - 1);
  Key bits;
  std::memcpy(&bits, &v, sizeof bits);
  return static_cast<Key>(bits & kSign ? ~bits : bits | kSign);
}

template <typename T>
T from_order_key(KeyOf<T> key) {
  using Key = KeyOf<T>;
  constexpr Key kSign = Key(1) << (8 * sizeof(Key) - 1);
  const Key bits = static_cast<Key>(key & kSign ? key ^ kSign : ~key);
  T v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

constexpr int64_t kMaxThresholdBins = 4096;  // thresholds cost 32 (64 for double) bin evaluations each

template <typename scalar_t>
class RowCounter {
 public:
  using acc_t = at::opmath_type<scalar_t>;

  // `runs`: whether rows will be counted run by run (the thresholds are only worked out then).
  RowCounter(int64_t bins, double lo, double hi, double scale, bool runs)
      : bins_(make_hist1d_bins<acc_t>(bins, lo, hi)), scale_(static_cast<acc_t>(scale)) {
    if (!runs || bins > kMaxThresholdBins) return;
    // thresholds_[k], 0 < k < bins: the smallest x whose bin is k or more, by bisection over
    // the floats between lo (bin 0) and hi (the last bin); the bin rule is monotone in x.
    thresholds_.resize(bins);
    for (int64_t k = 1; k < bins; ++k) {
      auto below = order_key(bins_.lo), reached = order_key(bins_.hi);
      while (reached - below > 1) {
        const auto middle = static_cast<KeyOf<acc_t>>(below + (reached - below) / 2);
        (hist1d_slot(from_order_key<acc_t>(middle), bins_) >= k ? reached : below) = middle;
      }
      thresholds_[k] = from_order_key<acc_t>(reached);
    }
  }

  // Whether rows can be counted run by run over sorted values (else count_each).
  bool counts_runs() const { return !thresholds_.empty(); }

  acc_t value(scalar_t u, scalar_t v) const { return scale_ * static_cast<acc_t>(outer_element(u, v)); }

  int32_t slot(scalar_t u, scalar_t v) const { return hist1d_slot(value(u, v), bins_); }

  // Adds the bins of u * values[j], j < len, one by one (NaN goes to the discard slot).
  void count_each(scalar_t u, const scalar_t* values, int64_t len, int64_t* counts) const {
    for (int64_t j = 0; j < len; ++j) ++counts[slot(u, values[j])];
  }

  // count_each for a whole row, vectorised: the slots of a batch of products at once, then
  // counted over the thread's interleaved copies (products in one bin do not wait on one
  // counter), as hist1d counts the formed products.
  void count_row(scalar_t u, const scalar_t* values, int64_t len, SlotCounter& thread) const {
    for (int64_t start = 0; start < len; start += kSlotBatch) {
      const int64_t batch = std::min(kSlotBatch, len - start);
      if (bins_.inverse_span != acc_t(0)) {
        outer_hist1d_slots<true>(u, values + start, batch, scale_, bins_, thread.slots());
      } else {
        outer_hist1d_slots<false>(u, values + start, batch, scale_, bins_, thread.slots());
      }
      thread.count(batch);
    }
  }

  // For u == 0: the `finite` finite values among them all land in the bin of ±0.
  void count_zero_row(int64_t finite, int64_t* counts) const {
    counts[slot(scalar_t(0), scalar_t(0))] += finite;
  }

  // The same as count_each for ascending, NaN-free values, run by run: with u finite and
  // nonzero, x = scale * (u * v) is monotone in v, so bin k's run ends where x first reaches
  // thresholds_[k + 1]. That position is guessed by a binary search for v = threshold / slope
  // with plain comparisons, then settled on the products themselves (the very values the
  // materialised op bins: the counts are exact, whatever the guess).
  void count_sorted(scalar_t u, const scalar_t* sorted, int64_t len, int64_t* counts) const {
    if (len == 0) return;  // every v was NaN: no product is counted
    const acc_t slope = scale_ * static_cast<acc_t>(u);
    if (!std::isfinite(slope) || slope == 0) return count_each(u, sorted, len, counts);
    if (slope > 0) return count_runs<true>(u, slope, sorted, len, counts);
    count_runs<false>(u, slope, sorted, len, counts);
  }

 private:
  // count_sorted for a slope of one sign: x = scale * (u * v) ascends in v if kRising, else
  // descends; position i below walks the values in ascending x.
  template <bool kRising>
  void count_runs(scalar_t u, acc_t slope, const scalar_t* sorted, int64_t len, int64_t* counts) const {
    const auto at = [&](int64_t i) { return sorted[kRising ? i : len - 1 - i]; };
    int32_t bin = slot(u, at(0));
    const int32_t last = slot(u, at(len - 1));
    int64_t start = 0;  // first position of `bin`'s run
    for (int32_t first = bin + 1; first <= last; first += kSearches) {
      const int count = static_cast<int>(std::min<int32_t>(kSearches, last - first + 1));
      // Guesses of where runs first .. first + count - 1 end: for each, the first position whose
      // v is not before threshold / slope (at most len - 1). The searches are branch-free (their
      // turns are unpredictable) and interleaved (independent, so their loads overlap).
      acc_t target[kSearches];
      int64_t guess[kSearches];
      for (int i = 0; i < count; ++i) {
        target[i] = thresholds_[first + i] / slope;
        guess[i] = 0;
      }
      for (int64_t n = len; n > 1; n -= n / 2) {
        const int64_t half = n / 2;
        for (int i = 0; i < count; ++i) {
          const acc_t v = static_cast<acc_t>(at(guess[i] + half - 1));
          guess[i] += static_cast<int64_t>(kRising ? v < target[i] : v > target[i]) * half;
        }
      }
      for (int i = 0; i < count; ++i) {
        const int32_t k = first + i;
        const int64_t end = run_end(u, thresholds_[k], std::max(guess[i], start), start, len, at);
        counts[bin] += end - start;
        start = end;
        bin = k;
      }
    }
    counts[bin] += len - start;
  }

  // The first position from `start` whose x reaches `threshold`, settled on the products
  // themselves from a guess: the last position reaches it. Gallops from the guess to bracket it
  // between `no` (does not reach, or start - 1) and `yes` (reaches), then bisects.
  template <typename At>
  int64_t run_end(scalar_t u, acc_t threshold, int64_t guess, int64_t start, int64_t len,
                  const At& at) const {
    const auto reaches = [&](int64_t i) { return value(u, at(i)) >= threshold; };
    int64_t yes = guess, no = guess, step = 1;
    if (reaches(yes)) {
      for (no = yes - 1; no >= start && reaches(no); no = yes - step) {
        yes = no;
        step *= 2;
      }
      no = std::max(no, start - 1);
    } else {
      for (yes = std::min(no + 1, len - 1); !reaches(yes); yes = std::min(no + step, len - 1)) {
        no = yes;
        step *= 2;
      }
    }
    while (yes - no > 1) {
      const int64_t middle = no + (yes - no) / 2;
      (reaches(middle) ? yes : no) = middle;
    }
    return yes;
  }

  static constexpr int kSearches = 8;  // binary searches run interleaved
  Hist1dBins<acc_t> bins_;
  acc_t scale_;
  std::vector<acc_t> thresholds_;
};

// Sorts n NaN-free values ascending by LSD radix sort on their order keys, one byte a pass:
// O(n) per pass where std::sort costs O(n log n) comparisons. The digit counts of every pass
// come from one read of the values. `scratch` holds n values. Passes whose byte is the same
// for every value are skipped.
template <typename scalar_t>
void radix_sort(scalar_t* values, scalar_t* scratch, int64_t n) {
  constexpr int kPasses = sizeof(scalar_t);
  int64_t starts[kPasses][257] = {};
  for (int64_t i = 0; i < n; ++i) {
    const auto key = order_key(values[i]);
    for (int pass = 0; pass < kPasses; ++pass) ++starts[pass][((key >> (8 * pass)) & 0xFF) + 1];
  }
  scalar_t* from = values;
  scalar_t* to = scratch;
  for (int pass = 0; pass < kPasses; ++pass) {
    int64_t* start = starts[pass];
    if (std::any_of(start + 1, start + 257, [n](int64_t c) { return c == n; })) continue;
    for (int digit = 0; digit < 256; ++digit) start[digit + 1] += start[digit];
    const unsigned shift = 8 * pass;
    for (int64_t i = 0; i < n; ++i) to[start[(order_key(from[i]) >> shift) & 0xFF]++] = from[i];
    std::swap(from, to);
  }
  if (from != values) std::copy(from, from + n, values);
}

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
  const RowCounter<scalar_t> counter(bins, lo, hi, scale, sorting_pays(p, q));
  const bool sort = counter.counts_runs();
  count_histogram(counts, n, grain_for(p * q), [&](int64_t begin, int64_t end, SlotCounter& thread) {
    int64_t* mine = thread.counters();
    std::vector<scalar_t> sorted(sort ? q : 0), scratch(sort ? q : 0);
    for (int64_t sample = begin; sample < end; ++sample) {
      const scalar_t* u = rows + sample * p;
      const scalar_t* v = columns + sample * q;
      const int64_t finite = std::count_if(v, v + q, [](scalar_t x) {
        return std::isfinite(static_cast<acc_t>(x));
      });
      int64_t len = 0;
      if (sort) {  // NaN times anything is NaN and never counted: leave those values out.
        len = std::copy_if(v, v + q, sorted.begin(), [](scalar_t x) {
                return !is_nan(static_cast<acc_t>(x));
              }) - sorted.begin();
        radix_sort(sorted.data(), scratch.data(), len);
      }
      for (int64_t i = 0; i < p; ++i) {
        if (static_cast<acc_t>(u[i]) == 0) {
          counter.count_zero_row(finite, mine);
        } else if (sort) {
          counter.count_sorted(u[i], sorted.data(), len, mine);
        } else {
          counter.count_row(u[i], v, q, thread);
        }
      }
    }
  });
}

at::Tensor outer_hist1d_cpu(const at::Tensor& left, const at::Tensor& right, int64_t bins,
                            double lo, double hi, double scale) {
  OuterHist1dArgs args = outer_hist1d_args(left, right, bins, lo, hi, scale);
  if (args.left.numel() > 0 && args.right.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, left.scalar_type(), "outer_hist1d", [&] {
      outer_hist1d_kernel<scalar_t>(args.left, args.right, bins, lo, hi, scale, args.counts);
    });
  }
  return args.counts;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) { m.impl("outer_hist1d", &outer_hist1d_cpu); }

}  // namespace cockpit_fast
