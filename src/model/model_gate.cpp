#include "model/model_gate.h"

#include <cmath>
#include <cstdio>

#include "core/error.h"
#include "gate/paths.h"
#include "model/sampler.h"

namespace ptllm {

namespace {

// The calibration tokens: the prompt when the tokenizer covers it, else a fixed id pattern.
std::vector<int32_t> calibrationTokens(const Gpt2& m, const CharTokenizer* tok,
                                       const std::string& text, int n) {
  std::vector<int32_t> ids;
  if (tok) {
    try {
      ids = tok->encode(text, "calibration prompt");
    } catch (const Error&) {
      ids.clear();
    }
  }
  const int V = m.config().vocabSize;
  if (ids.empty())
    for (int i = 0; i < 16; ++i) ids.push_back(int32_t((i * 31 + 7) % V));
  std::vector<int32_t> out;
  while (int(out.size()) < n) out.push_back(ids[out.size() % ids.size()]);
  return out;
}

}  // namespace

std::vector<std::string> ModelGateReport::lines() const {
  if (path.empty()) return {};
  std::vector<std::string> out;
  if (workload.ran)
    for (auto& line : consoleLines(workload)) {
      // The workload result is named after the path; say which gate it is.
      const std::string head = "[ops] " + path + " gate";
      out.push_back(line.rfind(head, 0) == 0
                        ? "[ops] " + path + " workload gate" + line.substr(head.size())
                        : line);
    }
  if (!error.empty()) {
    out.push_back(
        fmt::format("[ops] {} model gates: could not run ({}) — f32 for this model", path, error));
    return out;
  }
  out.push_back(
      e2ePass ? fmt::format("[ops] {} end-to-end gate: {} greedy tokens identical to f32 — PASS",
                            path, e2eTokens)
              : fmt::format("[ops] {} end-to-end gate: greedy text diverges from f32 at token {} "
                            "of {} — FAIL — falling back to f32",
                            path, e2eFirstDiff, e2eTokens));
  out.push_back(fmt::format(
      "[ops] {} loss gate: loss f32={:.6f}, fast={:.6f}, rel diff={:.4f}% (limit {:.3f}%) — {}",
      path, lossF32, lossFast, 100 * lossRel, 0.1,
      !e2ePass   ? "not used"
      : lossPass ? "PASS — used in the training forward"
                 : "FAIL — sampling only, the training forward stays f32"));
  return out;
}

double lossGateRel(Gpt2& m, const int32_t* x, const int32_t* y, int B, int T, double* lossF32,
                   double* lossFast) {
  m.setForceF32(true);
  const double ref = m.forward(x, y, B, T);
  m.setForceF32(false);
  const bool train = m.pathAllowedInTraining();
  m.setPathUse(true, m.pathAllowedInInference());
  const double fast = m.forward(x, y, B, T);
  m.setPathUse(train, m.pathAllowedInInference());
  if (lossF32) *lossF32 = ref;
  if (lossFast) *lossFast = fast;
  const double rel = std::fabs(fast - ref) / std::max(1e-12, std::fabs(ref));
  return std::isfinite(rel) ? rel : INFINITY;
}

ModelGateReport runModelGates(Gpt2& m, const CharTokenizer* tok, const ModelGateOptions& opt) {
  ModelGateReport r;
  const PathEntry* path = m.fastPath(false);
  if (!path) return r;
  r.path = path->name;
  try {
    // Workload: real weights, real activations of the calibration prompt (f32 forward).
    {
      const int T = std::min(m.config().blockSize, 64);
      const auto toks = calibrationTokens(m, tok, opt.prompt, T);
      m.setForceF32(true);
      m.forward(toks.data(), nullptr, 1, T);
      m.setForceF32(false);
      const auto samples = m.linearSamples(T);
      std::vector<GateCase> cases;
      for (const auto& s : samples)
        cases.push_back({s.label, s.M, s.K, s.N, s.in.data(), s.w.data(), s.bias.data()});
      r.workload = runGateOnData(m.ops(), *path, cases);
      r.workloadPass = r.workload.pass;
    }
    // End-to-end: greedy generation, f32 then the fast path.
    const auto prompt = calibrationTokens(
        m, tok, opt.prompt, std::min<int>(int(opt.prompt.size()), m.config().blockSize / 2));
    SampleOptions so;
    so.tokens = opt.e2eTokens;
    so.temperature = 0;
    so.sentinelEvery = 0;
    Generator gen(m);
    m.setForceF32(true);
    const auto ref = gen.generate(prompt, so);
    m.setForceF32(false);
    const auto fast = gen.generate(prompt, so);
    r.e2eTokens = int(ref.size());
    for (size_t i = 0; i < ref.size(); ++i)
      if (i >= fast.size() || fast[i] != ref[i]) {
        r.e2eFirstDiff = int(i);
        r.e2ePass = false;
        break;
      }
    // Loss: one fixed batch through both forwards.
    const int T = std::min(m.config().blockSize, 64), B = 4;
    const auto toks = calibrationTokens(m, tok, opt.prompt, B * T + 1);
    std::vector<int32_t> x(toks.begin(), toks.begin() + B * T),
        y(toks.begin() + 1, toks.begin() + 1 + B * T);
    r.lossRel = lossGateRel(m, x.data(), y.data(), B, T, &r.lossF32, &r.lossFast);
    r.lossPass = std::isfinite(r.lossFast) && r.lossRel < opt.lossRelLimit;
  } catch (const std::exception& e) {
    m.setForceF32(false);
    r.error = e.what();
  }
  return r;
}

ModelGate::ModelGate(Gpt2& model, const CharTokenizer* tok, ModelGateOptions opt)
    : model_(model), opt_(std::move(opt)) {
  if (tok) tok_ = *tok;
  copy_ = std::make_unique<Gpt2>(model.ops(), model.config());
  model.ops().copy(copy_->paramData().data(), model.paramData().data(), model.numParams());
  copy_->setPaths(model.paths());
  future_ = std::async(std::launch::async,
                       [this] { return runModelGates(*copy_, tok_ ? &*tok_ : nullptr, opt_); });
}

ModelGate::~ModelGate() {
  if (future_.valid()) future_.wait();
}

const ModelGateReport& ModelGate::wait() {
  if (!report_) report_ = future_.get();
  return *report_;
}

const ModelGateReport& ModelGate::apply() {
  const ModelGateReport& r = wait();
  if (!applied_) {
    applied_ = true;
    for (const auto& line : r.lines()) gateLog(line);
    if (!r.path.empty()) model_.setPathUse(r.trainingOk(), r.inferenceOk());
  }
  return r;
}

}  // namespace ptllm
