#include "test_util.h"

#include <gtest/gtest.h>
#include <hwy/targets.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "core/rng.h"
#include "model/gpt2.h"

namespace ptllm::test {

std::vector<float> randomVector(size_t n, uint64_t seed, float lo, float hi) {
  Rng rng(seed);
  std::vector<float> v(n);
  for (auto& x : v) x = rng.uniform(lo, hi);
  return v;
}

void forEachSimdTarget(const std::function<void()>& fn) {
  for (int64_t target : hwy::SupportedAndGeneratedTargets()) {
    hwy::SetSupportedTargetsForTest(target);
    hwy::GetChosenTarget().Update(hwy::SupportedTargets());
    SCOPED_TRACE(hwy::TargetName(target));
    fn();
  }
  hwy::SetSupportedTargetsForTest(0);
  hwy::GetChosenTarget().Update(hwy::SupportedTargets());
}

std::vector<float> poisoned(size_t n) {
  return std::vector<float>(n, std::numeric_limits<float>::quiet_NaN());
}

bool allFinite(const float* x, size_t n) {
  for (size_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

double worstRatio(const float* a, const float* b, size_t n, double atol, double rtol) {
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    const double r = std::isnan(d) ? INFINITY : d / (atol + rtol * std::fabs(double(b[i])));
    worst = std::max(worst, r);
  }
  return worst;
}

double maxAbsDiff(const float* a, const float* b, size_t n) {
  double worst = 0;
  for (size_t i = 0; i < n; ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    worst = std::isnan(d) ? INFINITY : std::max(worst, d);
  }
  return worst;
}

TempDir::TempDir() {
  std::string tmpl = (std::filesystem::temp_directory_path() / "ptllm-test-XXXXXX").string();
  if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

void writeText(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  if (!f) throw std::runtime_error("cannot write " + path);
}

std::vector<std::vector<float>> greedyStepLogits(Gpt2& m, const std::vector<int32_t>& prompt,
                                                 int steps,
                                                 const std::function<void()>& afterStep) {
  m.resetCache();
  std::vector<float> logits(size_t(m.config().vocabSize), 0.f);
  m.forwardCached(prompt.data(), int(prompt.size()), logits.data());
  std::vector<std::vector<float>> all;
  for (int i = 0; i < steps; ++i) {
    const int32_t tok = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    m.forwardCached(&tok, 1, logits.data());
    if (afterStep) afterStep();
    all.push_back(logits);
  }
  return all;
}

std::string sampleText(size_t n, uint64_t seed) {
  static const char* kWords[] = {"the",  "king", "shall", "speak", "to",   "thee", "and", "my",
                                 "lord", "of",   "love",  "night", "what", "is",   "a",   "good"};
  Rng rng(seed);
  std::string s;
  while (s.size() < n) {
    s += kWords[rng.below(16)];
    s += rng.below(8) == 0 ? ".\n" : " ";
  }
  s.resize(n);
  return s;
}

}  // namespace ptllm::test
