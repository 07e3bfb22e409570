// Device helpers of the reduced-precision weight formats (f16, bf16, fp8-e4m3): element sizes,
// the widening to f32 and the streamed 16-byte weight load. Shared by the storage GEMV
// (matmul_storage.cu) and the fused decode step (decode_step.cu), so both widen a weight to the
// same f32 value. C++17 (nvcc).
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace ptllm::cuda {

enum class Fmt { F16, BF16, FP8 };

template <Fmt F>
__host__ __device__ constexpr int elemBytes() {
  return F == Fmt::FP8 ? 1 : 2;
}
// Elements in one 16-byte vector.
template <Fmt F>
__host__ __device__ constexpr int perVec() {
  return 16 / elemBytes<F>();
}

// e4m3 widening without the conversion unit: the exponent-and-mantissa bits are moved into an
// f32's, which reads them as 2^-120 times the value, subnormals included (they land on f32
// denormals); one exact f32 multiply restores the scale. Inf/NaN never reach here (the pack
// saturates). f16 widens with its conversion instruction, bf16 (the high half of an f32) with a
// shift.
__device__ __forceinline__ float e4m3BitsToF32(uint32_t q) {  // q: 8 bits
  const uint32_t bits = ((q & 0x7fu) << 20) | ((q & 0x80u) << 24);
  return __uint_as_float(bits) * 0x1p120f;
}

template <Fmt F>
__device__ __forceinline__ void unpackVec(const uint4& v, float* f) {
  const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t w = words[i];
    if constexpr (F == Fmt::F16) {
      // One conversion instruction per element (exact); the bit-move widening it replaced
      // took three, and the decode step is bound by its instructions' latency.
      const __half2 h = *reinterpret_cast<const __half2*>(&w);
      f[2 * i] = __low2float(h);
      f[2 * i + 1] = __high2float(h);
    } else if constexpr (F == Fmt::BF16) {
      f[2 * i] = __uint_as_float(w << 16);
      f[2 * i + 1] = __uint_as_float(w & 0xffff0000u);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) f[4 * i + j] = e4m3BitsToF32((w >> (8 * j)) & 0xffu);
    }
  }
}

// A streamed weight load: read once per call, so keep it out of L1 and (kL2Prefetch) ask L2 for
// the whole 256-byte sector group (the next lanes' bytes arrive with it).
template <bool kL2Prefetch = true>
__device__ __forceinline__ uint4 loadStreaming(const uint4* p) {
  uint4 v;
  if constexpr (kL2Prefetch)
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  else
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  return v;
}

}  // namespace ptllm::cuda
