// CPU kernel of batch_dot: scale * <g[n], direction> for every sample, in one pass over g.
// Fixed column tiles and a fixed summation order keep results independent of the thread count.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cockpit_fast/entry.h"
#include "parallel.h"
#include "simd.h"

namespace cockpit_fast {
namespace {

template <typename scalar_t>
void batch_dot_kernel(const at::Tensor& rows, const at::Tensor& direction, double scale,
                      at::Tensor& dots) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n_rows = rows.size(0), n_cols = rows.size(1);
  const int64_t n_tiles = (n_cols + kDotTileColumns - 1) / kDotTileColumns;
  const scalar_t* data = rows.const_data_ptr<scalar_t>();
  const scalar_t* d = direction.const_data_ptr<scalar_t>();
  std::vector<acc_t> partials(n_rows * n_tiles);
  const acc_t s = static_cast<acc_t>(scale);

  at::parallel_for(0, n_rows * n_tiles, grain_for(std::min(kDotTileColumns, n_cols)), [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n = block / n_tiles, j0 = (block % n_tiles) * kDotTileColumns;
      const int64_t len = std::min(kDotTileColumns, n_cols - j0);
      partials[block] = dot_tile<scalar_t, acc_t>(data + n * n_cols + j0, d + j0, len, s);
    }
  });
  acc_t* out = dots.data_ptr<acc_t>();
  for (int64_t n = 0; n < n_rows; ++n) {
    double total = 0;  // double: a long row has many tiles
    for (int64_t t = 0; t < n_tiles; ++t) total += partials[n * n_tiles + t];
    out[n] = static_cast<acc_t>(total);
  }
}

at::Tensor batch_dot_cpu(const at::Tensor& g, const at::Tensor& direction, double scale) {
  BatchDotArgs args = batch_dot_args(g, direction, scale);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "batch_dot", [&] {
      batch_dot_kernel<scalar_t>(args.rows, args.direction, scale, args.dots);
    });
  }
  return args.dots;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) { m.impl("batch_dot", &batch_dot_cpu); }

}  // namespace cockpit_fast
