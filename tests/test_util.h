// Helpers shared by the tests: seeded data, poisoning, comparisons, temp dirs.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

namespace ptllm {
class Gpt2;
}

namespace ptllm::test {

std::vector<float> randomVector(size_t n, uint64_t seed, float lo = -1.0f, float hi = 1.0f);
// NaN-filled buffer: any element a kernel forgets to write shows up as NaN.
std::vector<float> poisoned(size_t n);
bool allFinite(const float* x, size_t n);
// max |a-b| / (atol + rtol*|b|) over the arrays; > 1 means out of tolerance. NaN counts as inf.
double worstRatio(const float* a, const float* b, size_t n, double atol, double rtol);
double maxAbsDiff(const float* a, const float* b, size_t n);

// Runs fn once per SIMD target that Highway compiled and this CPU supports (the CPU kernels'
// tile sizes differ per target), with a gtest trace naming it; restores normal dispatch after.
void forEachSimdTarget(const std::function<void()>& fn);

// A fresh directory under $TMPDIR, removed with its contents when the object dies.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// Greedy decode with the KV cache from an empty cache: the prompt, then `steps` tokens, each the
// argmax of the last logits. Returns each step's logits; afterStep runs after every step.
std::vector<std::vector<float>> greedyStepLogits(Gpt2& m, const std::vector<int32_t>& prompt,
                                                 int steps,
                                                 const std::function<void()>& afterStep = {});

void writeText(const std::string& path, const std::string& text);
// A deterministic pseudo-English text of about n bytes for training tests.
std::string sampleText(size_t n, uint64_t seed = 7);

}  // namespace ptllm::test
