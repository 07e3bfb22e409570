#include "app/engine.h"

#include <unistd.h>

#include <climits>
#include <cstdlib>

#include "core/error.h"
#include "core/file_io.h"
#include "core/thread_pool.h"
#include "gate/telemetry.h"
#include "kernels/cuda/cuda_device.h"

namespace ptllm::app {

void GlobalOptions::apply() const {
  setThreads(threads);
}

Engine makeEngine(const GlobalOptions& g) {
  Engine e;
  if (g.device != "cpu" && g.device != "cuda" && g.device != "auto")
    fail("--device {}: expected cpu, cuda or auto", g.device);
  // auto: the GPU when this binary has the CUDA backend and the machine a usable GPU.
  const bool cuda = g.device == "cuda" || (g.device == "auto" && cudaDeviceInfo().available);
  e.ops = cuda ? makeCudaOps() : makeCpuOps();  // makeCudaOps throws naming why it cannot
  std::string url = g.telemetryUrl;
  if (const char* env = std::getenv("PTLLM_TELEMETRY_URL"); url.empty() && env) url = env;
  if (!url.empty()) setTelemetryUrl(url);
  PathSetOptions opts;
  opts.useCache = true;  // warm starts reuse the verdict ($XDG_CACHE_HOME/ptllm)
  opts.regate = g.regate;
  opts.telemetry = true;  // $XDG_STATE_HOME/ptllm/telemetry.jsonl (+ the sink when set)
  e.paths = std::make_unique<PathSet>(*e.ops, PathSelection::parse(g.paths), opts);
  return e;
}

std::string bundledModelPath() {
  static const char* kRel = "models/shakespeare.safetensors";
  if (const char* env = std::getenv("PTLLM_MODEL"); env && *env) return env;
  char exe[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n > 0) {
    exe[n] = 0;
    std::string dir(exe);
    dir = dir.substr(0, dir.rfind('/'));
    for (const std::string& cand : {dir + "/../" + kRel, dir + "/../share/ptllm/" + kRel})
      if (fileExists(cand)) return cand;
  }
  const std::string src = std::string(PTLLM_SOURCE_DIR) + "/" + kRel;
  if (fileExists(src)) return src;
  fail("the bundled model ({}) was not found; pass --model CKPT", kRel);
}

}  // namespace ptllm::app
