// Prefetching a product's next weight panels into L2 while the current ones are used (they come
// from DRAM in every decode step): a slice per tile of rows, spread over the tile's steps of k.
// Issued as one burst per tile, the requests filled the miss buffers and stalled the tile's own
// loads (5-10% at decode shapes on a Zen 4, up to 30% for the AVX2 kernel at 32 rows).

#pragma once

#include <algorithm>
#include <cstdint>

namespace shoal {

struct Lines {
  const char* at;
  int64_t count;  // 64-byte cache lines from `at`
};

// Cuts the `bytes` from `next` (the next panels; 0 bytes when there are none) into one slice
// of lines per tile, for `tiles` tiles.
class PanelSlices {
 public:
  PanelSlices(const char* next, int64_t bytes, int64_t tiles)
      : next_(next), lines_(bytes / 64), per_tile_((lines_ + tiles - 1) / tiles) {}
  Lines take() {
    const Lines slice{next_ + done_ * 64, std::min(per_tile_, lines_ - done_)};
    done_ += slice.count;
    return slice;
  }

 private:
  const char* next_;
  int64_t lines_, per_tile_, done_ = 0;
};

// A tile's slice, a few lines per `step()` over `steps` steps.
class SpreadPrefetch {
 public:
  SpreadPrefetch(Lines slice, int64_t steps)
      : at_(slice.at), end_(slice.at + slice.count * 64),
        per_step_((slice.count + steps - 1) / steps) {}
  void step() {
    for (int64_t i = 0; i < per_step_ && at_ < end_; ++i, at_ += 64) __builtin_prefetch(at_, 0, 2);
  }

 private:
  const char* at_;
  const char* end_;
  int64_t per_step_;
};

}  // namespace shoal
