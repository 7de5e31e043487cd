// CPU kernel of factored_hist1d_batch_l2_batch_dots: hist1d_batch_l2_batch_dots of the per-sample
// gradients G[n] = left[n]^T right[n] (p, q) without writing them to memory. A task forms one row
// block of one G[n] with a GEMM (at::mm_out, MKL) into a thread-local scratch buffer small enough
// to stay in L2, then runs hist1d_batch_l2_batch_dots's tile loop (simd.h's
// hist1d_square_dot_tile, dot_tile for directions past the second) over it while it is in cache.
//
// Tasks are (row block, sample) in block-major order: consecutive tasks of a thread read the same
// rows of the directions, which then stay in cache. Per task the squares and dot products are
// summed in double over its tiles, and per sample over its blocks in block order: the results do
// not depend on the number of threads. They are not the formed route's bits (the GEMM's blocking
// rounds its own way, and tiles start at block starts), but agree with them to rounding.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cockpit_fast/entry.h"
#include "parallel.h"
#include "private_histograms.h"
#include "simd.h"

namespace cockpit_fast {
namespace {

// A task's scratch: a row block of G[n]. With the directions' rows it reads and the factors, it
// stays within a core's L2 (1 MiB here), leaving room for the histogram's counters.
constexpr int64_t kScratchBytes = int64_t(256) << 10;

static_assert(kDotTileColumns <= kSlotBatch, "a tile's slots fit in one batch");

template <int kDirections, typename scalar_t>
void factored_kernel(const at::Tensor& left, const at::Tensor& right, const at::Tensor& directions,
                     int64_t bins, double lo, double hi, double hist_scale, double scale,
                     at::Tensor& counts, at::Tensor& l2, at::Tensor& dots) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n_samples = left.size(0), n_positions = left.size(1);
  const int64_t p = left.size(2), q = right.size(2), k = directions.size(0);
  const int64_t rows_per_block =
      std::clamp<int64_t>(kScratchBytes / (q * int64_t(sizeof(scalar_t))), 1, p);
  const int64_t n_blocks = (p + rows_per_block - 1) / rows_per_block;
  const Hist1dBins<acc_t> b = make_hist1d_bins<acc_t>(bins, lo, hi);
  const acc_t hs = static_cast<acc_t>(hist_scale), s = static_cast<acc_t>(scale);
  const scalar_t* d = directions.const_data_ptr<scalar_t>();
  const int64_t d_stride = p * q;
  // square_partials[block, n] and dot_partials[(block, n), direction]: each written by one task.
  std::vector<double> square_partials(n_blocks * n_samples);
  std::vector<double> dot_partials(n_blocks * n_samples * k);

  count_histogram(counts, n_blocks * n_samples, grain_for(rows_per_block * q),
                  [&](int64_t begin, int64_t end, SlotCounter& counter) {
    // The GEMM's dispatch starts again from the top: its inputs may require grad (the op runs
    // below autograd, its results have none), and out= calls refuse those under autograd.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    int32_t* slots = counter.slots();
    at::Tensor scratch = at::empty({rows_per_block, q}, left.options());
    scalar_t* x = scratch.data_ptr<scalar_t>();
    acc_t squares[kDotTileColumns / kSquareTileColumns + 1];
    acc_t tile_dots[2];
    std::vector<double> task_dots(k);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t block = task / n_samples, n = task % n_samples;
      const int64_t r0 = block * rows_per_block, rows = std::min(rows_per_block, p - r0);
      at::Tensor g_block = scratch.narrow(0, 0, rows);
      if (n_positions == 0) {
        g_block.zero_();
      } else {
        at::mm_out(g_block, left.select(0, n).narrow(1, r0, rows).t(), right.select(0, n));
      }
      const int64_t len_block = rows * q, d_offset = r0 * q;
      double square_total = 0;
      std::fill(task_dots.begin(), task_dots.end(), 0.0);
      for (int64_t j0 = 0; j0 < len_block; j0 += kDotTileColumns) {
        const int64_t len = std::min(kDotTileColumns, len_block - j0);
        const scalar_t* d0 = kDirections > 0 ? d + d_offset + j0 : nullptr;
        const scalar_t* d1 = kDirections > 1 ? d + d_stride + d_offset + j0 : nullptr;
        if (b.inverse_span != acc_t(0)) {
          hist1d_square_dot_tile<true, kDirections>(x + j0, len, hs, b, slots, s, squares, d0, d1, tile_dots);
        } else {
          hist1d_square_dot_tile<false, kDirections>(x + j0, len, hs, b, slots, s, squares, d0, d1, tile_dots);
        }
        for (int64_t t = 0; t * kSquareTileColumns < len; ++t) square_total += squares[t];
        for (int64_t i = 0; i < kDirections; ++i) task_dots[i] += tile_dots[i];
        for (int64_t i = kDirections; i < k; ++i) {
          task_dots[i] += dot_tile<scalar_t, acc_t>(x + j0, d + i * d_stride + d_offset + j0, len, s);
        }
        counter.count(len);
      }
      square_partials[task] = square_total;
      for (int64_t i = 0; i < k; ++i) dot_partials[task * k + i] = task_dots[i];
    }
  });

  acc_t* l2_out = l2.data_ptr<acc_t>();
  acc_t* dots_out = dots.data_ptr<acc_t>();
  for (int64_t n = 0; n < n_samples; ++n) {
    double total = 0;
    for (int64_t block = 0; block < n_blocks; ++block) total += square_partials[block * n_samples + n];
    l2_out[n] = static_cast<acc_t>(total);
    for (int64_t i = 0; i < k; ++i) {
      double dot = 0;
      for (int64_t block = 0; block < n_blocks; ++block) dot += dot_partials[(block * n_samples + n) * k + i];
      dots_out[n * k + i] = static_cast<acc_t>(dot);
    }
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> factored_hist1d_batch_l2_batch_dots_cpu(
    const at::Tensor& left, const at::Tensor& right, const at::Tensor& directions, int64_t bins,
    double lo, double hi, double hist_scale, double scale) {
  FactoredHist1dBatchL2BatchDotsArgs args = factored_hist1d_batch_l2_batch_dots_args(
      left, right, directions, bins, lo, hi, hist_scale, scale);
  if (args.left.size(0) > 0 && args.left.size(2) > 0 && args.right.size(2) > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, left.scalar_type(),
                                    "factored_hist1d_batch_l2_batch_dots", [&] {
      const auto kernel = [&](auto directions_in_loop) {
        factored_kernel<decltype(directions_in_loop)::value, scalar_t>(
            args.left, args.right, args.directions, bins, lo, hi, hist_scale, scale, args.counts,
            args.l2, args.dots);
      };
      with_directions_in_loop(args.directions.size(0), kernel);
    });
  }
  return {args.counts, args.l2, args.dots};
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) {
  m.impl("factored_hist1d_batch_l2_batch_dots", &factored_hist1d_batch_l2_batch_dots_cpu);
}

}  // namespace cockpit_fast
