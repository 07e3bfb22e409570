// The CUDA backend's host-side API (plain C++: includable without CUDA headers, and linked
// from the stub when the binary is built without CUDA). Detection never throws: a machine
// without a GPU, a driver or a CUDA build just reports `available = false` with the reason.
#pragma once

#include <cstddef>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

namespace ptllm {

struct CudaDeviceInfo {
  bool built = false;      // this binary has the CUDA backend
  bool available = false;  // a usable GPU was found (device 0)
  std::string reason;      // why not available ("built without CUDA", "no CUDA device", ...)
  std::string name;        // "NVIDIA H200"
  int ccMajor = 0, ccMinor = 0;
  int multiprocessors = 0;
  size_t totalMemBytes = 0;
  size_t l2Bytes = 0;
  int driverVersion = 0;        // e.g. 13000
  int runtimeVersion = 0;       // e.g. 13000
  bool tensorCoresF16 = false;  // mma.sync f16 -> f32 (sm_70+; we use the sm_80 shapes)
  bool fp8 = false;             // e4m3 tensor cores (sm_89+)
  bool wgmma = false;           // Hopper warpgroup MMA + TMA (our sm_90a code: cc 9.0 exactly)
  nlohmann::json toJson() const;
  std::string summary() const;  // "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB, driver 13.0)"
};

// Detected once (thread-safe); the same object afterwards.
const CudaDeviceInfo& cudaDeviceInfo();

// Waits for every queued GPU operation (no-op without CUDA).
void cudaSynchronize();

// Median milliseconds of `fn` (which enqueues GPU work on the backend's stream), timed with
// CUDA events around each call after `warmup` untimed calls. Throws without a GPU.
double cudaMedianMs(const std::function<void()>& fn, int iters, int warmup = 3);

}  // namespace ptllm
