// What every model-running command sets up: the backend's ops, its gated paths (gates start in
// the background now), and where the bundled model lives.
#pragma once

#include <memory>
#include <string>

#include "app/commands.h"
#include "gate/paths.h"
#include "kernels/ops.h"

namespace ptllm::app {

struct Engine {
  std::unique_ptr<Ops> ops;
  std::unique_ptr<PathSet> paths;
};

// --device cpu|cuda|auto and --paths; throws ptllm::Error on an unusable choice.
Engine makeEngine(const GlobalOptions& g);

// The checkpoint shipped with the project (models/shakespeare.safetensors), found next to the
// binary, in the source tree it was built from, or at $PTLLM_MODEL.
std::string bundledModelPath();

}  // namespace ptllm::app
