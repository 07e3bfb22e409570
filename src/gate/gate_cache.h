// The gate cache: a path's verdict and numbers, stored so that a warm start skips the gate.
//
// Where: $XDG_CACHE_HOME/ptllm/ (default ~/.cache/ptllm/), one file per path,
// gate-<path>.json. What makes an entry valid (its key, stored in full in the file and compared
// exactly): the CPU model and every capability flag, Highway's dispatched target, the build id
// of the running binary (a hash of /proc/self/exe: any rebuild invalidates the cache), the
// backend, the path's name, its kernels' identity within the binary, its gate shapes, probes,
// thresholds and seed. A file that is unreadable, not JSON, of another format or of another key
// is ignored (the gate runs) and rewritten; nothing here ever throws. Writes are atomic.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "gate/capabilities.h"
#include "gate/gate.h"
#include "kernels/registry.h"

namespace ptllm {

// $XDG_CACHE_HOME/ptllm, else $HOME/.cache/ptllm ("" when neither is set).
std::string gateCacheDir();

// FNV-1a 64 of the running executable (/proc/self/exe), computed once per process; 0 when it
// cannot be read.
uint64_t binaryBuildId();
std::string binaryBuildIdHex();

// The key of `e`'s gate on this machine and binary (see above). `backend` is Ops::name().
std::string gateCacheKey(const PathEntry& e, const Capabilities& caps, const std::string& backend,
                         uint64_t seed = kGateSeed);

// The cached result for `key` (cached = true), or nullopt (missing, corrupt or foreign file).
std::optional<GateResult> loadCachedGate(const std::string& path, const std::string& key);
// Stores `r` under `key`; returns false (and never throws) when the file cannot be written.
bool storeCachedGate(const std::string& path, const std::string& key, const GateResult& r);

}  // namespace ptllm
