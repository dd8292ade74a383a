// What the AMX kernels share: asking Linux for the tile registers, the tile configuration,
// and giving the tiles back when a parallel region is done with them.

#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define SHOAL_HAS_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace shoal {

constexpr int kTileRows = 16;  // rows of a full tile: keys read from a block at a time

// Linux lends a process AMX's tile registers only once it asks (arch_prctl); oneDNN asks too.
inline bool amx_ready() {
  constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool ready = syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  return ready;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row
  uint8_t rows[16] = {};
};

// Whether this thread configured the tiles since it last released them.
inline thread_local bool tiles_in_use = false;

inline void release_tiles() {
  if (tiles_in_use) _tile_release();
  tiles_in_use = false;
}

// Loads `config` on this thread (once per piece of work: oneDNN may have loaded its own).
inline void load_tiles(const TileConfig& config) {
  _tile_loadconfig(&config);
  tiles_in_use = true;
}

}  // namespace shoal
#else
#define SHOAL_HAS_AMX 0
namespace shoal {
inline void release_tiles() {}  // no tiles without AMX
}  // namespace shoal
#endif
