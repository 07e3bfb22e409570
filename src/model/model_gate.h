// Model-level gates (spec "Future work" 2 and past it), run when a model is loaded, in the
// background, on a private copy of its weights, for the fast path the matmul gates activated:
//  - workload: each distinct weight shape of the model (layer 0's c_attn, attn.c_proj, c_fc,
//    mlp.c_proj) gated with its real weights and the real activations of a calibration prompt;
//  - end-to-end: the first 100 greedy tokens of a fixed prompt on f32 and on the fast path must
//    be identical (else FAIL, with the first differing index);
//  - loss: the loss of a fixed batch through the fast forward and the f32 forward must agree
//    within 0.1% relative, or the path serves sampling only and never the training forward.
// The matmul gates (src/gate) answer "is the kernel right?"; these answer "does this model,
// with its real weights, behave the same?".
#pragma once

#include <future>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "gate/gate.h"
#include "model/gpt2.h"
#include "model/tokenizer.h"

namespace ptllm {

struct ModelGateOptions {
  int e2eTokens = 100;
  double lossRelLimit = 0.001;  // 0.1%
  std::string prompt = "ROMEO:\nBut soft, what light through yonder window breaks?\n";
};

struct ModelGateReport {
  std::string path;     // the fast path examined; empty: none was active, nothing to gate
  GateResult workload;  // the workload gate (runGateOnData on real weights and activations)
  bool workloadPass = true;
  bool e2ePass = true;
  int e2eFirstDiff = -1;  // first differing generated index, -1 when identical
  int e2eTokens = 0;
  bool lossPass = true;
  double lossF32 = 0, lossFast = 0, lossRel = 0;
  std::string error;  // a gate that could not run (counts as FAIL)
  bool inferenceOk() const { return error.empty() && workloadPass && e2ePass; }
  bool trainingOk() const { return inferenceOk() && lossPass; }
  std::vector<std::string> lines() const;  // console lines, "[ops] ..." each
};

// |loss_fast - loss_f32| / |loss_f32| of one batch through `model`'s training forward with and
// without its fast path (0 when no path is active). Leaves the model's path use unchanged.
double lossGateRel(Gpt2& model, const int32_t* x, const int32_t* y, int B, int T,
                   double* lossF32 = nullptr, double* lossFast = nullptr);

// Runs the gates synchronously on `model` (which it changes: caches, path use).
ModelGateReport runModelGates(Gpt2& model, const CharTokenizer* tok,
                              const ModelGateOptions& opt = {});

// Starts runModelGates on a copy of `model` (same config, weights and PathSet) on a background
// thread. apply() waits, prints the lines once, and sets `model`'s path use accordingly.
class ModelGate {
 public:
  ModelGate(Gpt2& model, const CharTokenizer* tok, ModelGateOptions opt = {});
  ~ModelGate();
  ModelGate(const ModelGate&) = delete;
  ModelGate& operator=(const ModelGate&) = delete;
  const ModelGateReport& wait();
  const ModelGateReport& apply();

 private:
  Gpt2& model_;
  std::unique_ptr<Gpt2> copy_;
  std::optional<CharTokenizer> tok_;
  ModelGateOptions opt_;
  std::future<ModelGateReport> future_;
  std::optional<ModelGateReport> report_;
  bool applied_ = false;
};

}  // namespace ptllm
