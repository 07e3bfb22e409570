// ptllm gate [--json]: runs the gate of every selected, supported path and prints the spec's
// console lines (on stderr as always, and on stdout): one per gate shape and probe, then the
// path's summary line ("(cached)" when the verdict came from the gate cache; --regate re-runs
// it). Exit code 0 once every gate has run, whatever the verdicts: a FAIL is the gate doing
// its job.
#include <cstdio>
#include <string>

#include "app/commands.h"
#include "app/engine.h"
#include "gate/paths.h"

namespace ptllm::app {
namespace {

void runGateCommand(const GlobalOptions& g, bool json) {
  g.apply();
  Engine engine = makeEngine(g);  // --device, --paths; the gates start here
  Ops* ops = engine.ops.get();
  PathSet& set = *engine.paths;
  const PathSelection& sel = set.selection();
  const std::vector<GateResult> results = set.results();
  if (json) {
    nlohmann::json j;
    j["capabilities"] = set.capabilities().toJson();
    j["backend"] = ops->name();
    j["paths_selection"] = sel.toString();
    nlohmann::json arr = nlohmann::json::array();
    for (const auto& r : results) arr.push_back(toJson(r));
    j["results"] = arr;
    j["pills"] = set.activePills();
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  double total = 0;
  for (const auto& r : results) {
    for (const auto& line : consoleLines(r)) std::printf("%s\n", line.c_str());
    total += r.millis;
  }
  std::printf("gates: %.1f ms in all\n", total);
}

}  // namespace

void addGateCommand(CLI::App& app, GlobalOptions& g) {
  auto json = std::make_shared<bool>(false);
  CLI::App* cmd = app.add_subcommand(
      "gate", "Run every path's precision gate against the f32 reference and print the verdicts");
  cmd->add_flag("--json", *json, "Print the results as JSON");
  cmd->callback([&g, json] { runGateCommand(g, *json); });
}

}  // namespace ptllm::app
