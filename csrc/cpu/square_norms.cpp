// CPU kernels of batch_l2, sum_grad_squared and batch_l2_and_sum_grad_squared: one pass over g
// that squares every value once and feeds both sums.
//
// Work is split into fixed (row group x column tile) blocks, never by thread count, and the
// partial sums are added in a fixed order: results do not depend on the number of threads.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "cockpit_fast/entry.h"
#include "parallel.h"
#include "simd.h"

namespace cockpit_fast {
namespace {

constexpr int64_t kGroupRows = 64;

// Squares of scale * x[0..len): returns their sum; adds each square to column_sums if kColumns.
template <bool kColumns, typename scalar_t, typename acc_t>
COCKPIT_FAST_SIMD_CLONES acc_t square_tile(const scalar_t* x, int64_t len, acc_t scale, acc_t* column_sums) {
  acc_t lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= len; j += kLanes) {
    COCKPIT_FAST_LANES_SIMD
    for (int k = 0; k < kLanes; ++k) {
      const acc_t v = scale * static_cast<acc_t>(x[j + k]);
      const acc_t square = v * v;
      lanes[k] += square;
      if constexpr (kColumns) column_sums[j + k] += square;
    }
  }
  for (; j < len; ++j) {
    const acc_t v = scale * static_cast<acc_t>(x[j]);
    lanes[0] += v * v;
    if constexpr (kColumns) column_sums[j] += v * v;
  }
  acc_t total = 0;
  for (int k = 0; k < kLanes; ++k) total += lanes[k];
  return total;
}

template <bool kRows, bool kColumns, typename scalar_t>
void square_norms_kernel(const at::Tensor& rows, double scale, at::Tensor& l2,
                         at::Tensor& sum_sq) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n_rows = rows.size(0), n_cols = rows.size(1);
  const int64_t n_tiles = (n_cols + kSquareTileColumns - 1) / kSquareTileColumns;
  const int64_t n_groups = (n_rows + kGroupRows - 1) / kGroupRows;
  const scalar_t* data = rows.const_data_ptr<scalar_t>();
  const acc_t s = static_cast<acc_t>(scale);
  // row_partials[n, tile] and column_partials[group, j]: each written by exactly one block.
  std::vector<acc_t> row_partials(kRows ? n_rows * n_tiles : 0);
  std::vector<acc_t> column_partials(kColumns ? n_groups * n_cols : 0, acc_t(0));

  const int64_t values_per_block = std::min(n_rows, kGroupRows) * std::min(n_cols, kSquareTileColumns);
  at::parallel_for(0, n_groups * n_tiles, grain_for(values_per_block), [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t group = block / n_tiles, tile = block % n_tiles;
      const int64_t j0 = tile * kSquareTileColumns, len = std::min(kSquareTileColumns, n_cols - j0);
      const int64_t n_end = std::min(n_rows, (group + 1) * kGroupRows);
      acc_t* columns = kColumns ? column_partials.data() + group * n_cols + j0 : nullptr;
      for (int64_t n = group * kGroupRows; n < n_end; ++n) {
        const acc_t row = square_tile<kColumns>(data + n * n_cols + j0, len, s, columns);
        if constexpr (kRows) row_partials[n * n_tiles + tile] = row;
      }
    }
  });

  if constexpr (kRows) {
    acc_t* out = l2.data_ptr<acc_t>();
    at::parallel_for(0, n_rows, grain_for(n_tiles), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        double total = 0;  // double: a long row has many tiles
        for (int64_t t = 0; t < n_tiles; ++t) total += row_partials[n * n_tiles + t];
        out[n] = static_cast<acc_t>(total);
      }
    });
  }
  if constexpr (kColumns) {
    acc_t* out = sum_sq.data_ptr<acc_t>();
    at::parallel_for(0, n_cols, grain_for(n_groups), [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        double total = 0;  // double: a large batch has many row groups
        for (int64_t group = 0; group < n_groups; ++group) total += column_partials[group * n_cols + j];
        out[j] = static_cast<acc_t>(total);
      }
    });
  }
}

template <bool kRows, bool kColumns>
SquareNormsArgs square_norms_cpu(const char* op, const at::Tensor& g, double scale) {
  SquareNormsArgs args = square_norms_args(op, g, scale);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "square_norms", [&] {
      square_norms_kernel<kRows, kColumns, scalar_t>(args.rows, scale, args.l2, args.sum_sq);
    });
  }
  args.sum_sq = args.sum_sq.view(g.sizes().slice(1));
  return args;
}

at::Tensor batch_l2_cpu(const at::Tensor& g, double scale) {
  return square_norms_cpu<true, false>("batch_l2", g, scale).l2;
}

at::Tensor sum_grad_squared_cpu(const at::Tensor& g, double scale) {
  return square_norms_cpu<false, true>("sum_grad_squared", g, scale).sum_sq;
}

std::tuple<at::Tensor, at::Tensor> batch_l2_and_sum_grad_squared_cpu(const at::Tensor& g,
                                                                     double scale) {
  SquareNormsArgs args = square_norms_cpu<true, true>("batch_l2_and_sum_grad_squared", g, scale);
  return {args.l2, args.sum_sq};
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) {
  m.impl("batch_l2", &batch_l2_cpu);
  m.impl("sum_grad_squared", &sum_grad_squared_cpu);
  m.impl("batch_l2_and_sum_grad_squared", &batch_l2_and_sum_grad_squared_cpu);
}

}  // namespace cockpit_fast
