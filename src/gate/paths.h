// PathSet: for one ops object, the registered paths this machine supports, each gated on a
// background thread when the set is created (the spec's GpuOps.create() + f16Ready). Each
// gate settles a shared future; forwardPath() waits only for the gates it needs.
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gate/capabilities.h"
#include "gate/gate.h"
#include "kernels/ops.h"
#include "kernels/registry.h"

namespace ptllm {

// Where gate console lines go (each once, when its gate settles: consoleLines(r), the summary
// last). Default: a line on stderr.
// Process-wide; setting it is thread-safe; returns the previous sink. An empty function
// restores the default.
using GateLogSink = std::function<void(const std::string& line)>;
GateLogSink setGateLogSink(GateLogSink sink);
void gateLog(const std::string& line);  // sends one line to the current sink

// --paths: "auto" (every path that passes), "f32" (canonical only), or "a,b" (auto limited to
// those names). parse() throws ptllm::Error naming an unknown path.
struct PathSelection {
  enum class Mode { Auto, F32Only, Only } mode = Mode::Auto;
  std::vector<std::string> names;
  static PathSelection parse(const std::string& text);  // names checked against registeredPaths()
  static PathSelection parse(const std::string& text, const std::vector<PathEntry>& known);
  bool allows(const std::string& name) const;
  std::string toString() const;
};

// How a PathSet settles its gates beyond running them. Defaults: a fresh gate, nothing stored
// (what tests expect); `ptllm` turns the cache and telemetry on (app/engine.cpp).
struct PathSetOptions {
  bool useCache = false;   // reuse a cached verdict (gate/gate_cache.h) and store fresh ones
  bool regate = false;     // with useCache: ignore the cached verdict, run and rewrite it
  bool telemetry = false;  // append each result that ran (or came from the cache) to the
                           // telemetry file and sink (gate/telemetry.h)
};

class PathSet {
 public:
  // Gates every entry of `entries` whose device matches ops.device(), that `sel` allows and
  // whose required capabilities `caps` has. Returns at once; the gates run in the background.
  // `ops` must outlive the set and accept calls from the gate thread.
  PathSet(Ops& ops, PathSelection sel, Capabilities caps, std::vector<PathEntry> entries,
          PathSetOptions options = {});
  PathSet(Ops& ops, PathSelection sel,  // detected capabilities, pathsFor(ops.device())
          PathSetOptions options = {});
  ~PathSet();  // waits for the gate thread
  PathSet(const PathSet&) = delete;
  PathSet& operator=(const PathSet&) = delete;

  // The first active path (in registry order) for the forward linear layers; waits for the
  // gates before it to settle. nullptr: use the canonical f32 matmul.
  const PathEntry* forwardPath();
  // The future of one path's gate (also for unsupported / deselected paths: settled at once).
  // Throws ptllm::Error for a name not in the set.
  std::shared_future<GateResult> ready(const std::string& name) const;
  // Waits for every gate; one result per entry, in registry order.
  std::vector<GateResult> results() const;
  bool isActive(const std::string& name);
  std::vector<std::string> activePills();  // e.g. {"+f16 storage"}
  std::string statusClause();              // e.g. " · f16-storage matmul active" or ""
  const PathSelection& selection() const { return sel_; }
  const Capabilities& capabilities() const { return caps_; }
  const std::vector<PathEntry>& entries() const { return entries_; }
  const PathSetOptions& options() const { return options_; }

 private:
  struct Slot;
  Ops& ops_;
  PathSelection sel_;
  Capabilities caps_;
  std::vector<PathEntry> entries_;
  PathSetOptions options_;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::thread thread_;
};

}  // namespace ptllm
