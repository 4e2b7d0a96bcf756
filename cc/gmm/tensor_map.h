// TMA descriptors (CUtensorMap) of row-major 2D arrays, encoded on the host
// for each call (they hold the buffers' addresses) by the driver's
// cuTensorMapEncodeTiled, found through the runtime (no libcuda link).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace jax_ep {

// Whether the driver has the encoder (CUDA >= 12).
bool has_tensor_map_encoder();

// `map` of a row-major [rows, cols] array of `elem_bytes` elements at `ptr`,
// boxes of box_rows x box_cols; false when the driver has no encoder or
// rejects the arguments.
bool encode_2d(CUtensorMap* map, CUtensorMapDataType type, const void* ptr, uint64_t rows,
               uint64_t cols, uint32_t elem_bytes, uint32_t box_rows, uint32_t box_cols,
               CUtensorMapSwizzle swizzle);

}  // namespace jax_ep
