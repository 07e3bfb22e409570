#include "core/half.h"

#include <bit>
#include <cmath>

namespace ptllm {

uint16_t f32ToF16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u)  // NaN: keep the top payload bits, force quiet
    return static_cast<uint16_t>(sign | 0x7e00u | ((ax & 0x7fffffu) >> 13));
  if (ax == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
  const int e = static_cast<int>(ax >> 23) - 127 + 15;  // f16 biased exponent
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7c00u);
  uint32_t h, rem, half;
  if (e <= 0) {  // f16 subnormal (or zero): value = h * 2^-24
    const uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    const int shift = 14 - e;
    if (shift > 24) return sign;  // below half the smallest subnormal
    h = m >> shift;
    rem = m & ((1u << shift) - 1u);
    half = 1u << (shift - 1);
  } else {
    h = (static_cast<uint32_t>(e) << 10) | ((ax & 0x7fffffu) >> 13);
    rem = ax & 0x1fffu;
    half = 0x1000u;
  }
  if (rem > half || (rem == half && (h & 1u))) ++h;  // carries into the exponent correctly
  if (h >= 0x7c00u) h = 0x7c00u;
  return static_cast<uint16_t>(sign | h);
}

float f16ToF32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {
    float v = std::ldexp(static_cast<float>(mant), -24);  // exact
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112u) << 23) | (mant << 13));
}

uint16_t f32ToBf16(float f) {
  const uint32_t x = std::bit_cast<uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x0040u);
  const uint32_t rounded = x + 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(rounded >> 16);
}

float bf16ToF32(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

}  // namespace ptllm
