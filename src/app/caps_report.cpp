#include "app/caps_report.h"

#include <fmt/format.h>

namespace ptllm::app {

nlohmann::json capsReport(Ops& ops, PathSet& set) {
  const std::vector<GateResult> results = set.results();
  const Capabilities& caps = set.capabilities();
  nlohmann::json j;
  j["capabilities"] = caps.toJson();
  j["backend"] = ops.name();
  j["paths_selection"] = set.selection().toString();
  nlohmann::json paths = nlohmann::json::array();
  for (size_t i = 0; i < results.size(); ++i) {
    const PathEntry& e = set.entries()[i];
    nlohmann::json pj = toJson(results[i]);
    pj["pill"] = e.pill;
    pj["device"] = deviceName(e.device);
    pj["requires"] = e.requiredCaps;
    pj["missing"] = caps.missing(e.requiredCaps);
    paths.push_back(pj);
  }
  j["paths"] = paths;
  j["pills"] = set.activePills();
  const PathEntry* fwd = set.forwardPath();
  j["forward_path"] = fwd ? fwd->name : std::string("f32");
  return j;
}

std::string statusLine(double warmupSeconds, const PathEntry* path) {
  return fmt::format("inference warmed up in {:.1f}s{} — ready to generate.", warmupSeconds,
                     path ? " · " + path->statusClause + " active" : std::string());
}

}  // namespace ptllm::app
