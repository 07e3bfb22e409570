// IEEE binary16 and bfloat16 <-> f32 conversions, bit-exact and portable (no F16C needed):
// round to nearest even, subnormals exact, NaN stays NaN (quiet, top payload bits kept), f16
// overflow becomes inf. The one definition used by the f16 packers and the checkpoint I/O.
#pragma once

#include <cstdint>

namespace ptllm {

uint16_t f32ToF16(float f);
float f16ToF32(uint16_t h);
uint16_t f32ToBf16(float f);
float bf16ToF32(uint16_t h);

}  // namespace ptllm
