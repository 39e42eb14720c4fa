// AMX tiles, shared by the kernels that use them (cpu_gemm.cpp, cpu_paged_extend.cpp):
// whether this process uses them, and the one tile configuration they all take
// (eight tiles of 16 rows x 64 bytes). A build for a CPU with AMX-BF16 defines
// RADIXSERVE_AMX; the loader enables the tiles at run time (set_amx in cpu_gemm.cpp).
#pragma once

#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define RADIXSERVE_AMX 1

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace radixserve_amx {

// Set by set_amx: the build has AMX, Linux granted the tile state and nothing hides AMX.
inline bool enabled = false;

// Linux hands a process AMX's tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
inline bool request_permission() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles 0-7 as 16 rows of 64 bytes, for this thread (until _tile_release).
inline void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

}  // namespace radixserve_amx

#endif  // RADIXSERVE_AMX
