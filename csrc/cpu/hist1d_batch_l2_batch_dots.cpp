// CPU kernel of hist1d_batch_l2_batch_dots: hist1d, batch_l2 and batch_dot against each of k
// directions from one pass over g. A task takes (sample, batch_dot tile) blocks; a block's values
// are read from memory once: one vectorised loop (simd.h's hist1d_square_dot_tile) bins them,
// squares them and multiplies them with the first two directions; further directions' dot_tile
// finds them in L1; the slots are then counted into the thread's private histogram while the
// cache is asked for the next block.
//
// The tiles, lanes and order of additions are those of the separate ops: the results are
// hist1d's, batch_l2's and batch_dot's bit for bit, on any number of threads.
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

static_assert(kDotTileColumns % kSquareTileColumns == 0, "a batch_dot tile is whole batch_l2 tiles");
static_assert(kDotTileColumns <= kSlotBatch, "a block's slots fit in one batch");
constexpr int64_t kSquaresPerDot = kDotTileColumns / kSquareTileColumns;

// kDirections = min(k, 2): the directions the fused loop takes.
template <int kDirections, typename scalar_t>
void hist1d_batch_l2_batch_dots_kernel(const at::Tensor& rows, const at::Tensor& directions,
                                       int64_t bins, double lo, double hi, double hist_scale,
                                       double scale, at::Tensor& counts, at::Tensor& l2,
                                       at::Tensor& dots) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n_rows = rows.size(0), n_cols = rows.size(1), k = directions.size(0);
  const int64_t n_dot_tiles = (n_cols + kDotTileColumns - 1) / kDotTileColumns;
  const int64_t n_square_tiles = (n_cols + kSquareTileColumns - 1) / kSquareTileColumns;
  const Hist1dBins<acc_t> b = make_hist1d_bins<acc_t>(bins, lo, hi);
  const acc_t hs = static_cast<acc_t>(hist_scale), s = static_cast<acc_t>(scale);
  const scalar_t* data = rows.const_data_ptr<scalar_t>();
  const scalar_t* d = directions.const_data_ptr<scalar_t>();
  // square_partials[n, batch_l2 tile] and dot_partials[n, direction, batch_dot tile]: each
  // written by exactly one block.
  std::vector<acc_t> square_partials(n_rows * n_square_tiles);
  std::vector<acc_t> dot_partials(n_rows * k * n_dot_tiles);

  // Blocks are (sample, batch_dot tile) in row-major order: a task's blocks are one run of g.
  const auto block_end = [&](int64_t block) {
    return (block / n_dot_tiles) * n_cols + std::min(n_cols, (block % n_dot_tiles + 1) * kDotTileColumns);
  };
  count_histogram(counts, n_rows * n_dot_tiles, grain_for(std::min(kDotTileColumns, n_cols)),
                  [&](int64_t begin, int64_t end, SlotCounter& counter) {
    int32_t* slots = counter.slots();
    const scalar_t* task_end = data + block_end(end - 1);
    acc_t tile_dots[2];
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n = block / n_dot_tiles, tile = block % n_dot_tiles, j0 = tile * kDotTileColumns;
      const int64_t len = std::min(kDotTileColumns, n_cols - j0);
      const scalar_t* x = data + n * n_cols + j0;
      acc_t* squares = square_partials.data() + n * n_square_tiles + tile * kSquaresPerDot;
      const int64_t dots_at = n * k * n_dot_tiles + tile;  // direction i at dots_at + i * n_dot_tiles
      const scalar_t* d0 = kDirections > 0 ? d + j0 : nullptr;
      const scalar_t* d1 = kDirections > 1 ? d + n_cols + j0 : nullptr;
      if (b.inverse_span != acc_t(0)) {
        hist1d_square_dot_tile<true, kDirections>(x, len, hs, b, slots, s, squares, d0, d1, tile_dots);
      } else {
        hist1d_square_dot_tile<false, kDirections>(x, len, hs, b, slots, s, squares, d0, d1, tile_dots);
      }
      for (int64_t i = 0; i < kDirections; ++i) dot_partials[dots_at + i * n_dot_tiles] = tile_dots[i];
      for (int64_t i = kDirections; i < k; ++i) {
        dot_partials[dots_at + i * n_dot_tiles] = dot_tile<scalar_t, acc_t>(x, d + i * n_cols + j0, len, s);
      }
      const int64_t next_len = std::min<int64_t>(kDotTileColumns, task_end - (x + len));
      counter.count(len, {x + len, next_len * int64_t(sizeof(scalar_t))});
    }
  });

  // Row sums as batch_l2 and batch_dot add them: in double, in tile order.
  acc_t* l2_out = l2.data_ptr<acc_t>();
  acc_t* dots_out = dots.data_ptr<acc_t>();
  at::parallel_for(0, n_rows, grain_for(n_square_tiles + k * n_dot_tiles), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      double total = 0;
      for (int64_t t = 0; t < n_square_tiles; ++t) total += square_partials[n * n_square_tiles + t];
      l2_out[n] = static_cast<acc_t>(total);
      for (int64_t i = 0; i < k; ++i) {
        double dot = 0;
        for (int64_t t = 0; t < n_dot_tiles; ++t) dot += dot_partials[(n * k + i) * n_dot_tiles + t];
        dots_out[n * k + i] = static_cast<acc_t>(dot);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> hist1d_batch_l2_batch_dots_cpu(
    const at::Tensor& g, const at::Tensor& directions, int64_t bins, double lo, double hi,
    double hist_scale, double scale) {
  Hist1dBatchL2BatchDotsArgs args =
      hist1d_batch_l2_batch_dots_args(g, directions, bins, lo, hi, hist_scale, scale);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "hist1d_batch_l2_batch_dots", [&] {
      const auto kernel = [&](auto directions_in_loop) {
        hist1d_batch_l2_batch_dots_kernel<decltype(directions_in_loop)::value, scalar_t>(
            args.rows, args.directions, bins, lo, hi, hist_scale, scale, args.counts, args.l2, args.dots);
      };
      with_directions_in_loop(args.directions.size(0), kernel);
    });
  }
  return {args.counts, args.l2, args.dots};
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) {
  m.impl("hist1d_batch_l2_batch_dots", &hist1d_batch_l2_batch_dots_cpu);
}

}  // namespace cockpit_fast
