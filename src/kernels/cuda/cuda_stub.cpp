// Built instead of the CUDA backend when nvcc is absent or PTLLM_CUDA=OFF.
#include "kernels/registry.h"

namespace ptllm {
std::vector<PathEntry> cudaPaths() {
  return {};
}
}  // namespace ptllm
