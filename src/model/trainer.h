// Training loop: character data with a 90/10 train/val split, seeded random batches, AdamW with
// warm-up + cosine decay and gradient clipping, periodic validation, atomic checkpoints with
// the optimizer state beside them, exact resume, a CSV loss log, and a stop flag (Ctrl-C).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "core/rng.h"
#include "kernels/ops.h"
#include "model/checkpoint.h"
#include "model/gpt2.h"
#include "model/tokenizer.h"

namespace ptllm {

struct TrainOptions {
  std::string dataPath;
  // The data itself, when it comes from memory (the playground's fine-tune): used instead of
  // reading dataPath, which then only names it in messages.
  std::string text;
  std::string outPath;
  std::string initPath;    // fine-tune from this checkpoint (its config and tokenizer)
  std::string resumePath;  // continue exactly from this checkpoint + its optimizer state
  ModelConfig model;       // vocabSize is set from the data (or taken from --init/--resume)
  int batchSize = 16;
  int steps = 1000;
  float lr = 1e-3f;
  float minLrFraction = 0.1f;  // cosine decays to lr * this
  int warmup = 100;
  float weightDecay = 0.1f;
  float beta1 = 0.9f, beta2 = 0.99f, eps = 1e-8f;
  float gradClip = 1.0f;
  int evalEvery = 100;   // 0: only at the end
  int evalBatches = 20;  // batches of the val split per periodic evaluation
  int saveEvery = 0;     // 0: only at the end
  uint64_t seed = 1337;
  std::string toJson() const;
  static TrainOptions fromJson(const std::string& json, const std::string& where);
};

// The text of a data file split as `ptllm train` and `ptllm eval` do: first 90% / last 10%.
struct TextSplit {
  std::vector<int32_t> train, val;
};
TextSplit splitTokens(const std::vector<int32_t>& tokens);

// Mean loss (nats/token) of `model` over `tokens` in consecutive windows of blockSize (at most
// maxWindows when > 0), batched by `batch`. Each window predicts its next characters.
double evaluateLoss(Gpt2& model, const std::vector<int32_t>& tokens, int batch, int maxWindows = 0);

struct StepReport {
  int step = 0;  // 1-based, steps done
  int totalSteps = 0;
  float trainLoss = 0, lr = 0, gradNorm = 0;
  double valLoss = -1;  // < 0: not evaluated at this step
  double tokPerSec = 0, elapsedSec = 0, etaSec = 0;
};

class Trainer {
 public:
  // Loads data and model (fresh, --init or --resume). Throws ptllm::Error on bad input.
  Trainer(Ops& ops, TrainOptions opts);
  ~Trainer();

  Gpt2& model() { return *model_; }
  const CharTokenizer& tokenizer() const { return tok_; }
  const TrainOptions& options() const { return opts_; }
  int stepsDone() const { return step_; }
  uint64_t dataRngState() const { return rng_.state(); }

  // One optimisation step on a random batch; returns its report (val loss when due).
  StepReport step();
  // Runs until opts.steps or until `stop` becomes true; saves at saveEvery and at the end.
  // Returns the last report. `onStep` sees every report.
  StepReport run(const std::atomic<bool>* stop,
                 const std::function<void(const StepReport&)>& onStep);
  // Writes checkpoint + optimizer state (+ appends nothing to the log).
  void save(const std::string& path);
  double validationLoss(int maxWindows = 0);
  std::string logPath() const;

 private:
  float learningRate(int step) const;
  void checkOutputPaths() const;
  void appendLog(const StepReport& r);

  Ops& ops_;
  TrainOptions opts_;
  CharTokenizer tok_;
  TextSplit data_;
  std::unique_ptr<Gpt2> model_;
  Rng rng_;
  int step_ = 0;
  double elapsed_ = 0;  // seconds of training so far (kept across resume)
  std::vector<int32_t> x_, y_;
};

}  // namespace ptllm
