// The skeleton of the CPU histogram kernels: per-thread histograms, counted from batches of
// slots, summed into the int64 counts (count_histogram). Integer counts merge exactly, so the
// result never depends on the number of threads. Small histograms get several interleaved
// copies per thread: a run of values in one bin then alternates between counters instead of
// waiting on one (data concentrated in few bins is the common case for gradients).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <vector>

#include "cockpit_fast/arithmetic.h"
#include "parallel.h"

namespace cockpit_fast {

// Slots a kernel computes per batch (a vectorised loop) before counting them: 8 KiB, in L1.
constexpr int64_t kSlotBatch = 2048;

// Memory a kernel will read after the current batch (see PrivateHistograms::count).
struct Upcoming {
  const void* begin = nullptr;
  int64_t bytes = 0;
};

class PrivateHistograms {
 public:
  // `slots` counters per histogram; the caller may use the last one as a discard slot.
  explicit PrivateHistograms(int64_t slots)
      : slots_(slots),
        copies_(slots <= 8192 ? 4 : 1),  // count() relies on 1 or 4
        threads_(at::get_num_threads()),
        stride_(padded(copies_ * slots)),
        counts_(static_cast<size_t>(threads_ * stride_ + kPadding), 0) {}

  // The calling thread's counters; valid inside at::parallel_for.
  int64_t* mine() { return first() + at::get_thread_num() * stride_; }

  // Counts slots[0..len) into the calling thread's counters, value i into copy i % copies.
  // Meanwhile it asks the cache for `upcoming`, the memory the caller reads next: counting
  // leaves the load ports idle, and the next slot loop then finds its values in L1 instead of
  // waiting on L3 or memory (about twice as fast on inputs larger than L2).
  void count(int64_t* mine, const int32_t* slots, int64_t len, Upcoming upcoming = {}) const {
    const char* ahead = static_cast<const char*>(upcoming.begin);
    int64_t fetched = 0;
    int64_t* copy[4];
    for (int64_t k = 0; k < 4; ++k) copy[k] = mine + (k % copies_) * slots_;
    int64_t i = 0;
    for (; i + kBlock <= len; i += kBlock) {
      if (fetched < upcoming.bytes) {
        __builtin_prefetch(ahead + fetched);
        fetched += kCacheLine;
      }
      for (int64_t k = 0; k < kBlock; ++k) ++copy[k & 3][slots[i + k]];
    }
    for (; i < len; ++i) ++copy[i & 3][slots[i]];
    for (; fetched < upcoming.bytes; fetched += kCacheLine) __builtin_prefetch(ahead + fetched);
  }

  // Adds every thread's counters of slots [0, n_out) into out.
  void sum_into(int64_t* out, int64_t n_out) {
    for (int64_t thread = 0; thread < threads_; ++thread) {
      for (int64_t copy = 0; copy < copies_; ++copy) {
        const int64_t* counts = first() + thread * stride_ + copy * slots_;
        for (int64_t s = 0; s < n_out; ++s) out[s] += counts[s];
      }
    }
  }

 private:
  static constexpr int64_t kCacheLine = 64;
  static constexpr int64_t kBlock = 16;  // values counted per cache line asked for
  // Threads' counters start on their own pair of cache lines: a counter line shared by two
  // threads on two cores goes back and forth between them on every increment (the outer bins,
  // where clamped values land, sit at the edges of each thread's counters). Two lines, as
  // CPUs fetch lines in adjacent pairs.
  static constexpr int64_t kPadding = 2 * kCacheLine / int64_t(sizeof(int64_t));

  static int64_t padded(int64_t n) { return (n + kPadding - 1) / kPadding * kPadding + kPadding; }

  // The first counter at a kPadding-aligned address.
  int64_t* first() {
    const auto address = reinterpret_cast<uintptr_t>(counts_.data());
    const uintptr_t align = kPadding * sizeof(int64_t);
    return counts_.data() + ((align - address % align) % align) / sizeof(int64_t);
  }

  int64_t slots_, copies_, threads_, stride_;
  std::vector<int64_t> counts_;
};

// What a task of count_histogram counts with: a batch of slots and the thread's counters.
class SlotCounter {
 public:
  SlotCounter(const PrivateHistograms& histograms, int64_t* mine, int32_t* slots)
      : histograms_(histograms), mine_(mine), slots_(slots) {}

  // Room for kSlotBatch slots.
  int32_t* slots() { return slots_; }

  // Counts slots()[0..len), asking the cache for `upcoming` meanwhile (PrivateHistograms::count).
  void count(int64_t len, Upcoming upcoming = {}) { histograms_.count(mine_, slots_, len, upcoming); }

  // The thread's counters, for a kernel that adds counts to slots directly.
  int64_t* counters() { return mine_; }

 private:
  const PrivateHistograms& histograms_;
  int64_t* mine_;
  int32_t* slots_;
};

// Runs task(begin, end, counter) over the ranges at::parallel_for splits [0, n) into (at least
// `grain` items each), every thread counting into its own counters, then adds them into
// `counts` (int64, zero-filled). Slot counts.numel() is the discard slot, never written out.
template <typename Task>
void count_histogram(at::Tensor& counts, int64_t n, int64_t grain, const Task& task) {
  const int64_t counted = counts.numel();
  PrivateHistograms histograms(counted + 1);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    int32_t slots[kSlotBatch];
    SlotCounter counter(histograms, histograms.mine(), slots);
    task(begin, end, counter);
  });
  histograms.sum_into(counts.data_ptr<int64_t>(), counted);
}

// The hist2d bin along `axis` of each of values[0..n) (-1 for NaN): a parameter's bins, computed
// once for all samples.
template <typename scalar_t, typename acc_t>
std::vector<int32_t> axis_bins(const scalar_t* values, int64_t n, const Hist2dAxis<acc_t>& axis) {
  std::vector<int32_t> bins(n);
  at::parallel_for(0, n, kValuesPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) bins[k] = hist2d_axis_bin(static_cast<acc_t>(values[k]), axis);
  });
  return bins;
}

}  // namespace cockpit_fast
