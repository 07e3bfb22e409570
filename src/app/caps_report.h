// The capability report every front end shows: `ptllm caps --json` prints it, `ptllm serve`
// sends it to the page (which renders it as the pill cluster and the gate details).
#pragma once

#include <nlohmann/json.hpp>
#include <string>

#include "gate/paths.h"
#include "kernels/ops.h"

namespace ptllm::app {

// {capabilities, backend, paths_selection, paths: [gate result + pill, device, requires,
// missing], pills, forward_path}. Waits for every gate.
nlohmann::json capsReport(Ops& ops, PathSet& set);

// The spec's status line: "inference warmed up in 0.5s · f16-storage matmul active — ready to
// generate." (`path` is the path inference runs on; nullptr: f32, no clause).
std::string statusLine(double warmupSeconds, const PathEntry* path);

}  // namespace ptllm::app
