#include "gate/gate_cache.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <vector>

#include "core/file_io.h"

namespace ptllm {
namespace {

constexpr const char* kFormat = "ptllm-gate-cache-1";
constexpr uint64_t kFnvOffset = 0xcbf29ce484222325ull;
constexpr uint64_t kFnvPrime = 0x100000001b3ull;

uint64_t fnv1a(uint64_t h, const unsigned char* p, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    h ^= p[i];
    h *= kFnvPrime;
  }
  return h;
}

std::string safeName(const std::string& name) {
  std::string s;
  for (char c : name)
    s += (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '_') ? c : '_';
  return s;
}

}  // namespace

std::string gateCacheDir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x == '/')
    return std::string(x) + "/ptllm";
  if (const char* h = std::getenv("HOME"); h && *h) return std::string(h) + "/.cache/ptllm";
  return {};
}

uint64_t binaryBuildId() {
  static const uint64_t id = [] {
    std::FILE* f = std::fopen("/proc/self/exe", "rb");
    if (!f) return uint64_t(0);
    uint64_t h = kFnvOffset;
    std::vector<unsigned char> buf(1 << 20);
    size_t n;
    while ((n = std::fread(buf.data(), 1, buf.size(), f)) > 0) h = fnv1a(h, buf.data(), n);
    std::fclose(f);
    return h;
  }();
  return id;
}

std::string binaryBuildIdHex() {
  return fmt::format("{:016x}", binaryBuildId());
}

std::string gateCacheKey(const PathEntry& e, const Capabilities& caps, const std::string& backend,
                         uint64_t seed) {
  // The kernels' identity: their offsets from a function of this binary (stable across runs of
  // the same executable under ASLR; a test's variant with the real name gets its own key).
  const auto anchor = reinterpret_cast<uintptr_t>(&binaryBuildId);
  auto off = [anchor](const void* p) {
    return p ? fmt::format("{:x}", reinterpret_cast<uintptr_t>(p) - anchor) : std::string("-");
  };
  std::string k =
      fmt::format("{}|cpu={}|target={}|flags=", kFormat, caps.cpuModel, caps.dispatchedTarget);
  for (const auto& [name, on] : caps.flags)
    if (on) k += name + ",";
  k += fmt::format("|build={}|backend={}|path={}|device={}|kernels={},{},{}|seed={:x}",
                   binaryBuildIdHex(), backend, e.name, deviceName(e.device),
                   off(reinterpret_cast<const void*>(e.dispatch)),
                   off(reinterpret_cast<const void*>(e.prepare)),
                   off(reinterpret_cast<const void*>(e.packedBytes)), seed);
  k += fmt::format("|thr={},{},{}|shapes=", e.thresholds.maxAbsOfMeanRef, e.thresholds.meanRel,
                   e.thresholds.relFloorOfMeanRef);
  for (const auto& s : e.gateShapes) k += fmt::format("{}x{}x{},", s.M, s.K, s.N);
  k += "|probes=";
  for (const auto& p : e.gateProbes)
    k += fmt::format("{}:{}:{}x{}x{},", p.name, int(p.kind), p.shape.M, p.shape.K, p.shape.N);
  return k;
}

std::optional<GateResult> loadCachedGate(const std::string& path, const std::string& key) {
  const std::string dir = gateCacheDir();
  if (dir.empty()) return std::nullopt;
  const std::string file = dir + "/gate-" + safeName(path) + ".json";
  try {
    if (!fileExists(file)) return std::nullopt;
    const nlohmann::json j = nlohmann::json::parse(readTextFile(file));
    if (!j.is_object() || j.value("format", "") != kFormat || j.value("key", "") != key)
      return std::nullopt;
    GateResult r = gateResultFromJson(j.at("result"));
    if (r.path != path || !r.ran) return std::nullopt;
    r.cached = true;
    return r;
  } catch (const std::exception&) {
    return std::nullopt;  // corrupt: the gate runs and the file is rewritten
  }
}

bool storeCachedGate(const std::string& path, const std::string& key, const GateResult& r) {
  const std::string dir = gateCacheDir();
  if (!makeDirs(dir)) return false;
  try {
    GateResult stored = r;
    stored.cached = false;
    nlohmann::json j;
    j["format"] = kFormat;
    j["key"] = key;
    j["result"] = toJson(stored);
    writeFileAtomic(dir + "/gate-" + safeName(path) + ".json", j.dump(1));
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

}  // namespace ptllm
