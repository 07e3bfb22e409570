#include "model/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/file_io.h"
#include "gate/paths.h"
#include "model/model_gate.h"

namespace ptllm {

std::string TrainOptions::toJson() const {
  nlohmann::json j = {{"data", dataPath},
                      {"n_layer", model.nLayer},
                      {"n_head", model.nHead},
                      {"n_embd", model.nEmbd},
                      {"block_size", model.blockSize},
                      {"batch_size", batchSize},
                      {"steps", steps},
                      {"lr", lr},
                      {"min_lr_fraction", minLrFraction},
                      {"warmup", warmup},
                      {"weight_decay", weightDecay},
                      {"beta1", beta1},
                      {"beta2", beta2},
                      {"grad_clip", gradClip},
                      {"eval_every", evalEvery},
                      {"eval_batches", evalBatches},
                      {"save_every", saveEvery},
                      {"seed", seed}};
  return j.dump();
}

TrainOptions TrainOptions::fromJson(const std::string& text, const std::string& where) {
  auto j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) fail("{}: training options are not a JSON object", where);
  TrainOptions o;
  try {
    o.dataPath = j.at("data").get<std::string>();
    o.model.nLayer = j.at("n_layer");
    o.model.nHead = j.at("n_head");
    o.model.nEmbd = j.at("n_embd");
    o.model.blockSize = j.at("block_size");
    o.batchSize = j.at("batch_size");
    o.steps = j.at("steps");
    o.lr = j.at("lr");
    o.minLrFraction = j.at("min_lr_fraction");
    o.warmup = j.at("warmup");
    o.weightDecay = j.at("weight_decay");
    o.beta1 = j.at("beta1");
    o.beta2 = j.at("beta2");
    o.gradClip = j.at("grad_clip");
    o.evalEvery = j.at("eval_every");
    o.evalBatches = j.at("eval_batches");
    o.saveEvery = j.at("save_every");
    o.seed = j.at("seed");
  } catch (const nlohmann::json::exception& e) {
    fail("{}: training options: {}", where, e.what());
  }
  return o;
}

TextSplit splitTokens(const std::vector<int32_t>& tokens) {
  const size_t n = tokens.size() * 9 / 10;
  return {std::vector<int32_t>(tokens.begin(), tokens.begin() + long(n)),
          std::vector<int32_t>(tokens.begin() + long(n), tokens.end())};
}

double evaluateLoss(Gpt2& model, const std::vector<int32_t>& tokens, int batch, int maxWindows) {
  const int T = model.config().blockSize;
  if (tokens.size() < 2) fail("evaluation data has {} tokens; need at least 2", tokens.size());
  // Windows of T+1 tokens overlapping by one; the last window may be shorter.
  std::vector<std::pair<size_t, int>> windows;  // (start, length T_w)
  for (size_t s = 0; s + 1 < tokens.size(); s += size_t(T)) {
    windows.push_back({s, int(std::min<size_t>(size_t(T), tokens.size() - 1 - s))});
    if (maxWindows > 0 && int(windows.size()) >= maxWindows) break;
  }
  double total = 0;
  int64_t count = 0;
  std::vector<int32_t> x, y;
  for (size_t w = 0; w < windows.size();) {
    // Batch consecutive windows of the same length.
    const int len = windows[w].second;
    int b = 0;
    x.clear();
    y.clear();
    while (w < windows.size() && b < batch && windows[w].second == len) {
      const size_t s = windows[w].first;
      x.insert(x.end(), tokens.begin() + long(s), tokens.begin() + long(s) + len);
      y.insert(y.end(), tokens.begin() + long(s) + 1, tokens.begin() + long(s) + 1 + len);
      ++b;
      ++w;
    }
    const float loss = model.forward(x.data(), y.data(), b, len);
    total += double(loss) * b * len;
    count += int64_t(b) * len;
  }
  return total / double(count);
}

Trainer::Trainer(Ops& ops, TrainOptions opts) : ops_(ops), opts_(std::move(opts)), rng_(0) {
  if (!opts_.resumePath.empty()) {
    // Everything but the output path and the step count comes from the saved run.
    const std::string optimPath = optimizerPathFor(opts_.resumePath);
    LoadedModel lm = loadCheckpoint(ops_, opts_.resumePath);
    if (!lm.tokenizer) fail("{}: checkpoint has no tokenizer", opts_.resumePath);
    tok_ = *lm.tokenizer;
    model_ = std::move(lm.model);
    auto meta = loadOptimizerState(*model_, optimPath);
    if (!meta.count("train_options") || !meta.count("train_step") || !meta.count("data_rng"))
      fail("{}: not a training state file (train_options/train_step/data_rng missing)", optimPath);
    TrainOptions saved = TrainOptions::fromJson(meta["train_options"], optimPath);
    saved.outPath = opts_.outPath.empty() ? opts_.resumePath : opts_.outPath;
    if (opts_.steps > 0) saved.steps = opts_.steps;
    if (!opts_.dataPath.empty()) saved.dataPath = opts_.dataPath;
    saved.resumePath = opts_.resumePath;
    opts_ = saved;
    try {
      step_ = std::stoi(meta["train_step"]);
      rng_.setState(std::stoull(meta["data_rng"]));
      elapsed_ = meta.count("elapsed_s") ? std::stod(meta["elapsed_s"]) : 0.0;
    } catch (const std::exception&) {
      fail("{}: malformed train_step/data_rng metadata", optimPath);
    }
  }
  if (opts_.dataPath.empty()) fail("train: --data is required");
  if (opts_.outPath.empty()) fail("train: --out is required");
  if (opts_.batchSize < 1) fail("train: --batch-size must be >= 1 (got {})", opts_.batchSize);
  if (opts_.steps < 1) fail("train: --steps must be >= 1 (got {})", opts_.steps);
  if (!(opts_.lr > 0) || !std::isfinite(opts_.lr))
    fail("train: --lr must be > 0 (got {})", opts_.lr);
  if (opts_.warmup < 0) fail("train: --warmup must be >= 0 (got {})", opts_.warmup);
  if (opts_.evalEvery < 0) fail("train: --eval-every must be >= 0 (got {})", opts_.evalEvery);
  if (opts_.evalBatches < 1) fail("train: --eval-batches must be >= 1 (got {})", opts_.evalBatches);
  if (opts_.saveEvery < 0) fail("train: --save-every must be >= 0 (got {})", opts_.saveEvery);
  if (!(opts_.weightDecay >= 0) || !std::isfinite(opts_.weightDecay))
    fail("train: --weight-decay must be >= 0 (got {})", opts_.weightDecay);
  checkOutputPaths();
  const std::string text = opts_.text.empty() ? readTextFile(opts_.dataPath) : opts_.text;

  if (!opts_.initPath.empty() && !model_) {
    LoadedModel lm = loadCheckpoint(ops_, opts_.initPath);
    if (!lm.tokenizer)
      fail("{}: checkpoint has no character tokenizer to fine-tune with", opts_.initPath);
    tok_ = *lm.tokenizer;
    model_ = std::move(lm.model);
  }
  if (!model_) {
    tok_ = CharTokenizer::fromText(text, opts_.dataPath);
    opts_.model.vocabSize = tok_.size();
    model_ = std::make_unique<Gpt2>(ops_, opts_.model);
    model_->initRandom(opts_.seed);
    rng_.setState(opts_.seed ^ 0x5DEECE66Dull);
  } else if (opts_.resumePath.empty()) {
    opts_.model = model_->config();
    rng_.setState(opts_.seed ^ 0x5DEECE66Dull);
  }
  opts_.model = model_->config();
  data_ = splitTokens(tok_.encode(text, opts_.dataPath));
  const int T = opts_.model.blockSize;
  if (data_.train.size() < size_t(T) + 1)
    fail("{}: training split has {} characters; need more than block size {}", opts_.dataPath,
         data_.train.size(), T);
  if (data_.val.size() < 2)
    fail("{}: validation split has {} characters; need at least 2", opts_.dataPath,
         data_.val.size());
}

Trainer::~Trainer() = default;

void Trainer::checkOutputPaths() const {
  // Before any work: a run must not end, after hours, on an --out it cannot write, nor write
  // its checkpoint, optimizer state or log over an input.
  const std::string& out = opts_.outPath;
  if (isDirectory(out)) fail("train: --out {} is a directory; give a .safetensors file path", out);
  const std::string parent = std::filesystem::path(out).parent_path().string();
  const std::string dir = parent.empty() ? "." : parent;
  if (!isDirectory(dir)) fail("train: --out {}: directory {} does not exist", out, dir);
  if (::access(dir.c_str(), W_OK) != 0)
    fail("train: --out {}: directory {} is not writable", out, dir);
  const std::pair<const char*, std::string> inputs[] = {
      {"--data", opts_.text.empty() ? opts_.dataPath : std::string()},
      {"--init", opts_.initPath},
      {"--resume", opts_.resumePath}};
  for (const std::string& written : {out, optimizerPathFor(out), logPath()}) {
    for (const auto& [flag, input] : inputs) {
      // Resuming in place rewrites its own checkpoint: that is what --resume without --out means.
      if (input.empty() || (written == out && std::string(flag) == "--resume")) continue;
      if (sameFile(written, input))
        fail("train: the run would write {} over its {} input {}; choose another --out", written,
             flag, input);
    }
  }
}

float Trainer::learningRate(int step) const {
  if (step < opts_.warmup) return opts_.lr * float(step + 1) / float(opts_.warmup);
  const int decaySteps = std::max(1, opts_.steps - opts_.warmup);
  const double progress = std::min(1.0, double(step - opts_.warmup) / decaySteps);
  const double minLr = opts_.lr * opts_.minLrFraction;
  return float(minLr + 0.5 * (opts_.lr - minLr) * (1.0 + std::cos(M_PI * progress)));
}

double Trainer::validationLoss(int maxWindows) {
  return evaluateLoss(*model_, data_.val, opts_.batchSize, maxWindows);
}

StepReport Trainer::step() {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const int B = opts_.batchSize, T = opts_.model.blockSize;
  x_.resize(size_t(B) * T);
  y_.resize(size_t(B) * T);
  const uint64_t range = data_.train.size() - size_t(T);
  for (int b = 0; b < B; ++b) {
    const size_t off = size_t(rng_.below(range));
    for (int t = 0; t < T; ++t) {
      x_[size_t(b) * T + t] = data_.train[off + t];
      y_[size_t(b) * T + t] = data_.train[off + t + 1];
    }
  }
  Gpt2& m = *model_;
  m.invalidatePackedWeights();  // the spec's invalidateF16Cache at the top of trainStep
  StepReport r;
  // The loss gate again on the weights as they are now (after the first update and at every
  // evaluation): a path that, say, kept stale weights across an update is caught here and the
  // training forward goes back to f32.
  if ((step_ == 1 || (opts_.evalEvery > 0 && step_ % opts_.evalEvery == 0)) && m.fastPath(true)) {
    double ref = 0, fast = 0;
    const double rel = lossGateRel(m, x_.data(), y_.data(), B, T, &ref, &fast);
    if (!(rel < 0.001)) {
      m.setPathUse(false, m.pathAllowedInInference());
      gateLog(fmt::format(
          "[ops] {} loss gate at step {}: loss f32={:.6f}, fast={:.6f}, rel diff={:.4f}% (limit "
          "0.100%) — FAIL — the training forward stays f32",
          m.lastLinearPath(), step_, ref, fast, 100 * rel));
      m.invalidatePackedWeights();
    }
  }
  r.trainLoss = m.forward(x_.data(), y_.data(), B, T);
  if (!std::isfinite(r.trainLoss))
    fail("training diverged: loss is {} at step {}", r.trainLoss, step_ + 1);
  m.zeroGrad();
  m.backward();
  r.gradNorm = m.clipGradNorm(opts_.gradClip);
  r.lr = learningRate(step_);
  m.adamwStep(r.lr, opts_.beta1, opts_.beta2, opts_.eps, opts_.weightDecay);
  ++step_;
  const double dt = std::chrono::duration<double>(Clock::now() - t0).count();
  elapsed_ += dt;
  r.step = step_;
  r.totalSteps = opts_.steps;
  r.tokPerSec = double(B) * T / dt;
  r.elapsedSec = elapsed_;
  r.etaSec = dt * (opts_.steps - step_);
  const bool last = step_ >= opts_.steps;
  if ((opts_.evalEvery > 0 && step_ % opts_.evalEvery == 0) || last)
    r.valLoss = validationLoss(last ? 0 : opts_.evalBatches * opts_.batchSize);
  appendLog(r);
  return r;
}

StepReport Trainer::run(const std::atomic<bool>* stop,
                        const std::function<void(const StepReport&)>& onStep) {
  StepReport last;
  while (step_ < opts_.steps && !(stop && stop->load())) {
    last = step();
    if (onStep) onStep(last);
    if (opts_.saveEvery > 0 && step_ % opts_.saveEvery == 0 && step_ < opts_.steps)
      save(opts_.outPath);
  }
  save(opts_.outPath);
  return last;
}

void Trainer::save(const std::string& path) {
  std::map<std::string, std::string> meta = {{"train_step", std::to_string(step_)},
                                             {"data_rng", std::to_string(rng_.state())},
                                             {"elapsed_s", fmt::format("{:.3f}", elapsed_)},
                                             {"train_options", opts_.toJson()}};
  // Optimizer state first: a checkpoint on disk always has a matching (or newer) state.
  saveOptimizerState(*model_, optimizerPathFor(path), meta);
  saveCheckpoint(*model_, &tok_, path, {{"train_step", std::to_string(step_)}});
}

std::string Trainer::logPath() const {
  static const std::string kExt = ".safetensors";
  const std::string& o = opts_.outPath;
  return (o.ends_with(kExt) ? o.substr(0, o.size() - kExt.size()) : o) + ".log.csv";
}

void Trainer::appendLog(const StepReport& r) {
  const std::string path = logPath();
  const bool fresh = !fileExists(path) || (step_ == 1 && opts_.resumePath.empty());
  std::ofstream f(path, fresh ? std::ios::trunc : std::ios::app);
  if (!f) fail("{}: cannot write the loss log", path);
  if (fresh) f << "step,train_loss,val_loss,lr,grad_norm,tok_per_s,elapsed_s\n";
  f << fmt::format("{},{:.6f},{},{:.6g},{:.4f},{:.1f},{:.2f}\n", r.step, r.trainLoss,
                   r.valLoss >= 0 ? fmt::format("{:.6f}", r.valLoss) : std::string(), r.lr,
                   r.gradNorm, r.tokPerSec, r.elapsedSec);
}

}  // namespace ptllm
