// CPU kernel of per_sample_stats: every row is cut into fixed chunks of kStatsChunk values;
// each chunk is summarised from cache (two passes over the chunk, one over memory), then the
// chunk summaries of a row are merged in order. Chunking is fixed, never by thread count.
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
void per_sample_stats_kernel(const at::Tensor& rows, double scale,
                             const std::vector<double>& p_values, at::Tensor& stats) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t n_rows = rows.size(0), n_cols = rows.size(1);
  const int64_t n_chunks = (n_cols + kStatsChunk - 1) / kStatsChunk;
  const PValues<acc_t> p = make_p_values<acc_t>(p_values);
  const acc_t s = static_cast<acc_t>(scale);
  const scalar_t* data = rows.const_data_ptr<scalar_t>();
  std::vector<Summary<acc_t>> partials(n_rows * n_chunks);

  at::parallel_for(0, n_rows * n_chunks, grain_for(std::min(kStatsChunk, n_cols)), [&](int64_t begin, int64_t end) {
    std::vector<acc_t> values(kStatsChunk);
    for (int64_t block = begin; block < end; ++block) {
      const int64_t n = block / n_chunks, j0 = (block % n_chunks) * kStatsChunk;
      const int64_t len = std::min(kStatsChunk, n_cols - j0);
      partials[block] = summarize_run(data + n * n_cols + j0, len, s, p, values.data());
    }
  });

  acc_t* out = stats.data_ptr<acc_t>();
  const int64_t width = stats.size(1);
  at::parallel_for(0, n_rows, grain_for(n_chunks * kPowSum0), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      summaries_to_row(partials.data() + n * n_chunks, n_chunks, p, out + n * width);
    }
  });
}

at::Tensor per_sample_stats_cpu(const at::Tensor& g, double scale, at::ArrayRef<double> p_values) {
  const std::vector<double> ps(p_values.begin(), p_values.end());
  PerSampleStatsArgs args = per_sample_stats_args(g, scale, ps);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(),
                                    "per_sample_stats", [&] {
      per_sample_stats_kernel<scalar_t>(args.rows, scale, ps, args.stats);
    });
  }
  return args.stats;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CPU, m) { m.impl("per_sample_stats", &per_sample_stats_cpu); }

}  // namespace cockpit_fast
