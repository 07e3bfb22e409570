// The CUDA backend's gated paths (its part of the spec's ENTRIES), in order of preference: the
// first active one serves the forward linear layers. Decode (M=1) is bandwidth-bound, so the
// storage formats lead; the tensor-core paths follow for whoever selects them (--paths).
#include "kernels/cuda/cuda_paths.h"

#include "kernels/registry.h"

namespace ptllm {

namespace {

// The CPU entry's shapes (the spec's first, then its "Future work" workload shapes), plus a
// GPU-sized decode and prompt shape: a GPU path must hold at the sizes it is fast at.
std::vector<GateShape> cudaGateShapes() {
  return {{64, 128, 128},
          {1, 256, 768},
          {64, 1024, 256},
          {2, 50257, 8},
          {1, 4096, 4096, "decode 1x4096x4096"},
          {300, 768, 2304, "prompt 300x768x2304"}};
}

PathEntry storageEntry(std::string name, std::string pill, std::string clause, std::string active,
                       std::vector<std::string> caps, MatmulFn dispatch, PrepareFn prepare,
                       PackedBytesFn bytes) {
  PathEntry e;
  e.name = std::move(name);
  e.pill = std::move(pill);
  e.statusClause = std::move(clause);
  e.activeText = std::move(active);
  e.device = Device::CUDA;
  e.requiredCaps = std::move(caps);
  e.dispatch = dispatch;
  e.prepare = prepare;
  e.packedBytes = bytes;
  e.gateShapes = cudaGateShapes();
  e.gateProbes = standardGateProbes();
  e.thresholds = GateThresholds{};  // the spec's, for every path: no path gets a looser gate
  return e;
}

}  // namespace

std::vector<PathEntry> cudaPaths() {
  using namespace cuda;
  std::vector<PathEntry> paths;
  // The spec's path on its own hardware: half the weight bytes, f32 FFMA.
  paths.push_back(storageEntry("f16-storage", "+f16 storage", "f16-storage matmul",
                               "f16 path active", {"cuda"}, matmulF16, packF16, f16PackedBytes));
  paths.back().fusedDecode = true;  // decode_step.cu repeats matmulF16's M = 1 arithmetic
  // bf16 keeps f32's range (no overflow refusals) with 3 fewer mantissa bits than f16.
  paths.push_back(storageEntry("bf16-storage", "+bf16 storage", "bf16-storage matmul",
                               "bf16 path active", {"cuda"}, matmulBf16, packBf16, f16PackedBytes));
  // Our mma.sync kernel: f16 operands (activations row-scaled), f32 accumulators.
  paths.push_back(storageEntry("tensor-core-f16", "+tensor cores f16", "tensor-core f16 matmul",
                               "tensor-core path active", {"cuda_tensor_cores"},
                               matmulTensorCoreF16, packF16, f16PackedBytes));
  // The same operands through cuBLASLt (the platform-library lever).
  paths.push_back(storageEntry("cublaslt", "+cuBLASLt f16", "cuBLASLt f16 matmul",
                               "cuBLASLt path active", {"cuda_tensor_cores"}, matmulCublasLtF16,
                               packF16, f16PackedBytes));
  // A quarter of the f32 bytes: e4m3 with a scale per output channel.
  paths.push_back(storageEntry("fp8-e4m3", "+fp8 e4m3", "fp8-e4m3 matmul", "fp8 path active",
                               {"cuda_fp8"}, matmulFp8, packFp8, fp8PackedBytes));
  return paths;
}

}  // namespace ptllm
