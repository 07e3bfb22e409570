// The CUDA backend's gated fast paths (registry.h). None yet: the canonical f32 ops
// (cuda_ops.cu) are the only CUDA kernels, so this table is empty as in the stub.
#include "kernels/registry.h"

namespace ptllm {

std::vector<PathEntry> cudaPaths() {
  return {};
}

}  // namespace ptllm
