// Capability detection: "can this path run here?" (never "is it correct?", which is the gate's
// question). Named CPU feature flags from cpuid + the OS's XCR0 state, the CPU brand string and
// Highway's runtime targets. Detected once per process; tests remove a flag with withOut() to
// pretend it is missing.
#pragma once

#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace ptllm {

struct Capabilities {
  std::string cpuModel;  // cpuid brand string, e.g. "AMD EPYC 9654 96-Core Processor"
  std::vector<std::string> hwyTargets;  // Highway targets this CPU supports, best first
  std::string dispatchedTarget;         // the one the CPU kernels dispatched to
  // Flag name -> usable (CPU has it AND the OS saves its register state). Names, all listed
  // even when false: f16c fma avx avx2 avx512f avx512dq avx512bw avx512vl avx512_bf16
  // avx512_fp16 avx_vnni avx512_vnni amx_tile amx_bf16 amx_int8; and the GPU's: cuda (a usable
  // device 0), cuda_tensor_cores (f16 mma, sm_80+), cuda_fp8 (e4m3, sm_89+), cuda_wgmma
  // (Hopper warpgroup MMA + TMA, cc 9.0: the tensor-core-f16 path's large-M kernel).
  std::map<std::string, bool> flags;
  std::string gpu;         // "NVIDIA H200 (sm_90, ...)" or "no GPU: <why>"
  nlohmann::json gpuJson;  // kernels/cuda/cuda_device.h CudaDeviceInfo::toJson()

  // True when the flag is present and usable. Unknown names are false.
  bool has(const std::string& name) const;
  // A copy with `name` marked missing (the name is added if it was unknown).
  Capabilities withOut(const std::string& name) const;
  // The names of `required` that this set lacks, in order.
  std::vector<std::string> missing(const std::vector<std::string>& required) const;
  nlohmann::json toJson() const;
};

// Detected on the first call (thread-safe), the same object afterwards.
const Capabilities& detectCapabilities();

}  // namespace ptllm
