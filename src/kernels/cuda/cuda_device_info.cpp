// CudaDeviceInfo's formatting: shared by the CUDA build and the stub.
#include <fmt/format.h>

#include "kernels/cuda/cuda_device.h"

namespace ptllm {

nlohmann::json CudaDeviceInfo::toJson() const {
  nlohmann::json j;
  j["built"] = built;
  j["available"] = available;
  if (!available) j["reason"] = reason;
  if (!name.empty()) {
    j["name"] = name;
    j["compute_capability"] = fmt::format("{}.{}", ccMajor, ccMinor);
    j["multiprocessors"] = multiprocessors;
    j["memory_bytes"] = totalMemBytes;
    j["l2_bytes"] = l2Bytes;
    j["tensor_cores_f16"] = tensorCoresF16;
    j["fp8"] = fp8;
    j["wgmma"] = wgmma;
  }
  j["driver_version"] = driverVersion;
  j["runtime_version"] = runtimeVersion;
  return j;
}

std::string CudaDeviceInfo::summary() const {
  if (!available) return fmt::format("no GPU: {}", reason);
  return fmt::format("{} (sm_{}{}, {} SMs, {:.1f} GiB, L2 {} MiB, driver {}.{}, runtime {}.{})",
                     name, ccMajor, ccMinor, multiprocessors,
                     double(totalMemBytes) / (1024.0 * 1024 * 1024), l2Bytes >> 20,
                     driverVersion / 1000, driverVersion % 1000 / 10, runtimeVersion / 1000,
                     runtimeVersion % 1000 / 10);
}

}  // namespace ptllm
