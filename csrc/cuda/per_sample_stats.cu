// CUDA kernels of per_sample_stats. One block summarises one chunk of kStatsChunk values of one
// row: each thread keeps its values in registers (two passes, no second read of memory), then
// the block merges the thread summaries in shared memory. A second kernel merges a row's chunk
// summaries in chunk order. The per-value and merge arithmetic is arithmetic.h's, as on the CPU.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <torch/library.h>

#include <vector>

#include "cockpit_fast/cuda_common.cuh"
#include "cockpit_fast/entry.h"

namespace cockpit_fast {
namespace {

using namespace cockpit_fast::cuda;

constexpr int kValuesPerThread = static_cast<int>(kStatsChunk / kThreads);
static_assert(kValuesPerThread * kThreads == kStatsChunk, "a chunk must split evenly over a block");

template <typename scalar_t>
__global__ void chunk_summaries_kernel(const scalar_t* __restrict__ data, int64_t n_cols,
                                       int64_t n_chunks, at::opmath_type<scalar_t> scale,
                                       PValues<at::opmath_type<scalar_t>> p,
                                       Summary<at::opmath_type<scalar_t>>* __restrict__ partials) {
  using acc_t = at::opmath_type<scalar_t>;
  __shared__ Summary<acc_t> summaries[kThreads];
  const int64_t block = blockIdx.x;
  const int64_t n = block / n_chunks, j0 = (block % n_chunks) * kStatsChunk;
  const scalar_t* row = data + n * n_cols;

  // Strided by the block size so that each load instruction is coalesced; the values a thread
  // holds are a prefix of its slots, since j grows with k.
  acc_t values[kValuesPerThread];
  int count = 0;
#pragma unroll
  for (int k = 0; k < kValuesPerThread; ++k) {
    const int64_t j = j0 + static_cast<int64_t>(k) * kThreads + threadIdx.x;
    values[k] = j < n_cols ? scale * static_cast<acc_t>(row[j]) : acc_t(0);
    count += j < n_cols;
  }
  summaries[threadIdx.x] = summarize_values(values, count, p);
  __syncthreads();
  for (int half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) summary_merge(summaries[threadIdx.x], summaries[threadIdx.x + half], p);
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[block] = summaries[0];
}

template <typename acc_t>
__global__ void rows_from_summaries_kernel(const Summary<acc_t>* __restrict__ partials,
                                           int64_t n_rows, int64_t n_chunks, PValues<acc_t> p,
                                           acc_t* __restrict__ stats, int64_t width) {
  const int64_t n = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (n < n_rows) summaries_to_row(partials + n * n_chunks, n_chunks, p, stats + n * width);
}

at::Tensor per_sample_stats_cuda(const at::Tensor& g, double scale, at::ArrayRef<double> p_values) {
  const std::vector<double> ps(p_values.begin(), p_values.end());
  PerSampleStatsArgs args = per_sample_stats_args(g, scale, ps);
  const c10::cuda::CUDAGuard guard(g.device());
  const int64_t n_rows = args.rows.size(0), n_cols = args.rows.size(1);
  if (args.rows.numel() > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, g.scalar_type(), "per_sample_stats", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const int64_t n_chunks = (n_cols + kStatsChunk - 1) / kStatsChunk;
      TORCH_CHECK(n_rows * n_chunks < (int64_t(1) << 31), "cockpit_fast.per_sample_stats: ",
                  n_rows, " x ", n_cols, " values are too many for one CUDA grid");
      at::Tensor partials = at::empty({n_rows * n_chunks * static_cast<int64_t>(sizeof(Summary<acc_t>))},
                                      g.options().dtype(at::kByte));
      auto* summaries = reinterpret_cast<Summary<acc_t>*>(partials.data_ptr<uint8_t>());
      const PValues<acc_t> p = make_p_values<acc_t>(ps);
      const auto stream = current_stream();
      chunk_summaries_kernel<scalar_t><<<static_cast<unsigned int>(n_rows * n_chunks), kThreads, 0, stream>>>(
          args.rows.const_data_ptr<scalar_t>(), n_cols, n_chunks, static_cast<acc_t>(scale), p, summaries);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      const unsigned int row_blocks = static_cast<unsigned int>((n_rows + kThreads - 1) / kThreads);
      rows_from_summaries_kernel<acc_t><<<row_blocks, kThreads, 0, stream>>>(
          summaries, n_rows, n_chunks, p, args.stats.data_ptr<acc_t>(), args.stats.size(1));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  return args.stats;
}

}  // namespace

TORCH_LIBRARY_IMPL(cockpit_fast, CUDA, m) { m.impl("per_sample_stats", &per_sample_stats_cuda); }

}  // namespace cockpit_fast
