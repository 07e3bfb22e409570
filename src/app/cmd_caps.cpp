// ptllm caps [--json]: what this machine can do (CPU model, Highway targets, feature flags) and,
// per registered path, whether it is supported here, its gate verdict (with its per-shape and
// per-probe lines, "(cached)" for a cached verdict) and whether it is active.
#include <fmt/format.h>

#include <cstdio>
#include <string>

#include "app/caps_report.h"
#include "app/commands.h"
#include "app/engine.h"
#include "gate/paths.h"

namespace ptllm::app {
namespace {

std::string verdictText(const GateResult& r) {
  if (!r.supported) return "not supported (" + r.unsupportedReason + ")";
  if (!r.selected) return "not selected (--paths)";
  const GateMetric& m = r.metric;
  std::string s = r.pass ? "PASS" : "FAIL";
  if (!m.reason.empty()) s += " (" + m.reason + ")";
  return s +
         fmt::format(
             "  mean|ref|={:.2e} max_abs={:.2e} (limit {:.2e}) mean_rel={:.3f}% "
             "(limit {:.3f}%) max_rel={:.2f}%  {:.1f} ms",
             m.meanAbsRef, m.maxAbs, m.maxAbsLimit, m.meanRel * 100, m.meanRelLimit * 100,
             m.maxRel * 100, r.millis) +
         (r.cached ? "  (cached)" : "");
}

void runCaps(const GlobalOptions& g, bool json) {
  g.apply();
  Engine engine = makeEngine(g);  // --device, --paths; the gates start here
  Ops* ops = engine.ops.get();
  PathSet& set = *engine.paths;
  const PathSelection& sel = set.selection();
  const std::vector<GateResult> results = set.results();
  const Capabilities& caps = set.capabilities();
  const std::vector<std::string> pills = set.activePills();

  if (json) {
    std::printf("%s\n", capsReport(*ops, set).dump(2).c_str());
    return;
  }

  std::string targets;
  for (const auto& t : caps.hwyTargets) targets += (targets.empty() ? "" : " ") + t;
  std::printf("cpu:      %s\n", caps.cpuModel.c_str());
  std::printf("gpu:      %s\n", caps.gpu.c_str());
  std::printf("highway:  dispatched %s; supported %s\n", caps.dispatchedTarget.c_str(),
              targets.c_str());
  std::printf("flags:\n");
  for (const auto& [name, on] : caps.flags)
    std::printf("  %-12s %s\n", name.c_str(), on ? "yes" : "no");
  std::printf("paths (--paths %s, backend %s):\n", sel.toString().c_str(), ops->name());
  for (size_t i = 0; i < results.size(); ++i) {
    const GateResult& r = results[i];
    std::printf("  %-14s %-13s gate: %s  -> %s\n", r.path.c_str(),
                r.supported ? "detected" : "not detected", verdictText(r).c_str(),
                r.active() ? "active" : "inactive");
    if (r.ran)  // the per-shape and per-probe lines, then the summary
      for (const auto& line : consoleLines(r)) std::printf("    %s\n", line.c_str());
  }
  std::string pillText;
  for (const auto& p : pills) pillText += (pillText.empty() ? "" : " ") + p;
  std::printf("pills: %s\n", pillText.empty() ? "(none: f32 only)" : pillText.c_str());
}

}  // namespace

void addCapsCommand(CLI::App& app, GlobalOptions& g) {
  auto json = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand(
      "caps", "Detected capabilities, each path's gate verdict, and the active paths");
  cmd->add_flag("--json", *json, "Print the report as JSON");
  cmd->callback([&g, json] { runCaps(g, *json); });
}

}  // namespace ptllm::app
