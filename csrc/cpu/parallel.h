// How finely the CPU kernels split work for at::parallel_for.
#pragma once

#include <algorithm>
#include <cstdint>

namespace cockpit_fast {

// Fewest values one parallel task should visit: below this, waking threads costs more than the
// work itself, and small layers (biases, small convolutions) run on the calling thread.
constexpr int64_t kValuesPerTask = int64_t(1) << 15;

// at::parallel_for grain for items of `values_per_item` values each.
inline int64_t grain_for(int64_t values_per_item) {
  return std::max<int64_t>(1, kValuesPerTask / std::max<int64_t>(1, values_per_item));
}

}  // namespace cockpit_fast
