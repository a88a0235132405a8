// What the AMX kernels of cpu_ops.cpp and amx_linear.cpp share: the tile configuration's layout and the
// process's permission to use the tiles.
#pragma once

#include <cstdint>

// The 64-byte operand of ldtilecfg (palette 1): the rows and the bytes per row of each tile (8 used).
struct alignas(64) AmxTileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(AmxTileConfig) == 64, "an AMX tile configuration is 64 bytes");

// Whether Linux gave this process AMX tile state (asked for once, in amx_linear.cpp); AMX builds only.
bool amx_permitted();
