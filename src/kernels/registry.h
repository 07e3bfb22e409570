// The one table of gated fast paths (the spec's ENTRIES). A path is declared here and
// nowhere else: its name, pill, required capabilities, kernels, gate shapes and thresholds.
// "Can this path run here?" (capabilities) and "is it correct?" (the gate, src/gate) are
// separate questions; the registry only answers the first.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace ptllm {

// Same signature as the canonical f32 forward matmul (Ops::matmul) except that `w` is the
// path's weight format: out[M,N] = in[M,K] @ w[K,N] + bias[N] (bias may be null).
using MatmulFn = void (*)(float* out, const float* in, const void* w, const float* bias, int M,
                          int K, int N);
// Packs an f32 weight w[K,N] into dst (packedBytes(K,N) bytes, the backend's memory).
// Returns false when this matrix is ineligible for the path (e.g. |w| overflows f16); it then
// stays on f32.
using PrepareFn = bool (*)(void* dst, const float* w, int K, int N);
using PackedBytesFn = size_t (*)(int K, int N);

struct GateShape {
  int M, K, N;
  std::string label = {};  // optional name in reports; "MxKxN" when empty
};

// Range-stress probes (gate/gate.h documents each kind and how a probe is judged).
enum class ProbeKind {
  Outliers,   // activations with a few values 100x the rest, beyond the f16 range
  F16Limit,   // weights up to ~6e4 (just inside f16): f16 accumulation overflows
  BeyondF16,  // a few weights past the f16 range: the path must refuse (not eligible) or be right
  LargeK,     // a long dot product (K >= 4096) of typical values
};
struct GateProbe {
  std::string name;  // "outliers", "f16-limit", "beyond-f16", "large-k"
  ProbeKind kind;
  GateShape shape;
};

// The spec's magnitude-aware thresholds, as fractions.
struct GateThresholds {
  double maxAbsOfMeanRef = 0.01;    // max_abs < 1% of mean|ref|
  double meanRel = 0.005;           // mean_rel < 0.5%
  double relFloorOfMeanRef = 0.01;  // rel denominator floored at 1% of mean|ref|
};

struct PathEntry {
  std::string name;          // "f16-storage"
  std::string pill;          // "+f16 storage"
  std::string statusClause;  // "f16-storage matmul" (status line: "· <clause> active")
  std::string activeText;    // "f16 path active" (console line after PASS)
  Device device = Device::CPU;
  std::vector<std::string> requiredCaps;  // capability names (gate/capabilities.h), all needed
  // (not "requires": a C++20 keyword)
  MatmulFn dispatch = nullptr;
  PrepareFn prepare = nullptr;  // null: dispatch takes the f32 weight unchanged
  PackedBytesFn packedBytes = nullptr;
  std::vector<GateShape> gateShapes{{64, 128, 128}};  // the spec's shape first
  std::vector<GateProbe> gateProbes;                  // range-stress probes (may be empty)
  GateThresholds thresholds;
  // The backend's fused decode step (Ops::decodeStepFused) computes this path's M = 1 product
  // bit for bit from the packed weight (the CUDA f16-storage GEMV), so a step on this path may
  // run fused.
  bool fusedDecode = false;
};

// The standard probe set a storage-precision path should carry (see gate/gate.h).
std::vector<GateProbe> standardGateProbes();

// Every path built into this binary, in order of preference (first active one wins).
const std::vector<PathEntry>& registeredPaths();
// The entries of one backend, in registry order (names are unique within a backend; the CPU
// and CUDA backends each have an "f16-storage").
std::vector<PathEntry> pathsFor(Device device);
const PathEntry* findPath(const std::string& name);  // the first entry of that name

// Per-backend tables, concatenated by registeredPaths().
std::vector<PathEntry> cpuPaths();
std::vector<PathEntry> cudaPaths();  // empty when built without CUDA

}  // namespace ptllm
