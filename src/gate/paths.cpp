#include "gate/paths.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <optional>

#include "core/error.h"
#include "gate/gate_cache.h"
#include "gate/telemetry.h"

namespace ptllm {

// ---- log sink ----

namespace {
std::mutex& sinkMutex() {
  static std::mutex m;
  return m;
}
GateLogSink& sinkSlot() {
  static GateLogSink s;
  return s;
}
}  // namespace

GateLogSink setGateLogSink(GateLogSink sink) {
  std::lock_guard<std::mutex> lock(sinkMutex());
  GateLogSink old = std::move(sinkSlot());
  sinkSlot() = std::move(sink);
  return old;
}

void gateLog(const std::string& line) {
  GateLogSink sink;
  {
    std::lock_guard<std::mutex> lock(sinkMutex());
    sink = sinkSlot();
  }
  if (sink) {
    sink(line);
  } else {
    std::fprintf(stderr, "%s\n", line.c_str());
    std::fflush(stderr);
  }
}

// ---- PathSelection ----

namespace {
std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}
}  // namespace

PathSelection PathSelection::parse(const std::string& text) {
  return parse(text, registeredPaths());
}

PathSelection PathSelection::parse(const std::string& text, const std::vector<PathEntry>& known) {
  PathSelection sel;
  const std::string t = trim(text);
  if (t.empty() || t == "auto") return sel;
  if (t == "f32") {
    sel.mode = Mode::F32Only;
    return sel;
  }
  auto knownList = [&] {
    // One name per path: a path registered for several devices is listed once.
    std::vector<std::string> names = {"auto", "f32"};
    for (const auto& e : known)
      if (std::find(names.begin(), names.end(), e.name) == names.end()) names.push_back(e.name);
    return fmt::format("{}", fmt::join(names, ", "));
  };
  sel.mode = Mode::Only;
  size_t pos = 0;
  while (pos <= t.size()) {
    const size_t comma = t.find(',', pos);
    const std::string name = trim(t.substr(pos, comma == std::string::npos ? comma : comma - pos));
    if (name.empty()) fail("--paths '{}': empty path name; known: {}", text, knownList());
    if (name == "auto" || name == "f32")
      fail("--paths '{}': '{}' cannot be combined with path names; known: {}", text, name,
           knownList());
    bool found = false;
    for (const auto& e : known) found = found || e.name == name;
    if (!found) fail("--paths: unknown path '{}'; known: {}", name, knownList());
    sel.names.push_back(name);
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return sel;
}

bool PathSelection::allows(const std::string& name) const {
  switch (mode) {
    case Mode::Auto:
      return true;
    case Mode::F32Only:
      return false;
    case Mode::Only:
      for (const auto& n : names)
        if (n == name) return true;
      return false;
  }
  return false;
}

std::string PathSelection::toString() const {
  switch (mode) {
    case Mode::Auto:
      return "auto";
    case Mode::F32Only:
      return "f32";
    case Mode::Only: {
      std::string s;
      for (const auto& n : names) s += (s.empty() ? "" : ",") + n;
      return s;
    }
  }
  return "auto";
}

// ---- PathSet ----

struct PathSet::Slot {
  std::promise<GateResult> promise;
  std::shared_future<GateResult> future{promise.get_future().share()};
  bool run = false;  // written before the gate thread starts, read-only afterwards
};

PathSet::PathSet(Ops& ops, PathSelection sel, PathSetOptions options)
    : PathSet(ops, std::move(sel), detectCapabilities(), pathsFor(ops.device()), options) {}

PathSet::PathSet(Ops& ops, PathSelection sel, Capabilities caps, std::vector<PathEntry> entries,
                 PathSetOptions options)
    : ops_(ops),
      sel_(std::move(sel)),
      caps_(std::move(caps)),
      entries_(std::move(entries)),
      options_(options) {
  bool anyToRun = false;
  for (const PathEntry& e : entries_) {
    auto slot = std::make_unique<Slot>();
    GateResult r;
    r.path = e.name;
    r.activeText = e.activeText;
    r.metric.meanRelLimit = e.thresholds.meanRel;
    const std::vector<std::string> missing = caps_.missing(e.requiredCaps);
    if (e.device != ops_.device()) {
      r.unsupportedReason = fmt::format("needs the {} backend", deviceName(e.device));
    } else if (!missing.empty()) {
      r.unsupportedReason = "missing";
      for (size_t i = 0; i < missing.size(); ++i)
        r.unsupportedReason += (i ? ", " : " ") + missing[i];
    } else {
      r.supported = true;
    }
    r.selected = sel_.allows(e.name);
    slot->run = r.supported && r.selected;
    if (!slot->run) {
      gateLog(consoleLine(r));  // before settling: a waiter sees the line already printed
      slot->promise.set_value(r);
    }
    anyToRun = anyToRun || slot->run;
    slots_.push_back(std::move(slot));
  }
  if (!anyToRun) return;
  thread_ = std::thread([this] {
    for (size_t i = 0; i < slots_.size(); ++i) {
      Slot& s = *slots_[i];
      if (!s.run) continue;
      GateResult r;
      std::string key;
      std::optional<GateResult> hit;
      if (options_.useCache) {
        key = gateCacheKey(entries_[i], caps_, ops_.name());
        const auto t0 = std::chrono::steady_clock::now();
        if (!options_.regate) hit = loadCachedGate(entries_[i].name, key);
        if (hit)
          hit->millis =
              std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0)
                  .count();
      }
      try {
        if (hit) {
          r = std::move(*hit);
        } else {
          r = runGate(ops_, entries_[i]);  // catches what the path throws
          if (options_.useCache) storeCachedGate(entries_[i].name, key, r);
        }
      } catch (const std::exception& ex) {  // e.g. bad_alloc in the runner itself
        r.path = entries_[i].name;
        r.activeText = entries_[i].activeText;
        r.supported = r.selected = r.ran = true;
        r.metric.meanRelLimit = entries_[i].thresholds.meanRel;
        r.metric.reason = fmt::format("gate error: {}", ex.what());
      }
      for (const std::string& line : consoleLines(r)) gateLog(line);
      if (options_.telemetry) recordTelemetry(telemetryRecord(r, caps_, ops_.name()));
      s.promise.set_value(r);
    }
  });
}

PathSet::~PathSet() {
  if (thread_.joinable()) thread_.join();
}

const PathEntry* PathSet::forwardPath() {
  for (size_t i = 0; i < slots_.size(); ++i) {
    std::shared_future<GateResult> f = slots_[i]->future;
    if (f.get().active()) return &entries_[i];
  }
  return nullptr;
}

std::shared_future<GateResult> PathSet::ready(const std::string& name) const {
  for (size_t i = 0; i < entries_.size(); ++i)
    if (entries_[i].name == name) return slots_[i]->future;
  fail("PathSet::ready: no path named '{}'", name);
}

std::vector<GateResult> PathSet::results() const {
  std::vector<GateResult> out;
  for (const auto& s : slots_) {
    std::shared_future<GateResult> f = s->future;
    out.push_back(f.get());
  }
  return out;
}

bool PathSet::isActive(const std::string& name) {
  return ready(name).get().active();
}

std::vector<std::string> PathSet::activePills() {
  std::vector<std::string> pills;
  for (size_t i = 0; i < slots_.size(); ++i) {
    std::shared_future<GateResult> f = slots_[i]->future;
    if (f.get().active()) pills.push_back(entries_[i].pill);
  }
  return pills;
}

std::string PathSet::statusClause() {
  const PathEntry* e = forwardPath();
  return e ? " · " + e->statusClause + " active" : std::string();
}

}  // namespace ptllm
