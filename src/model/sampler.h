// Text generation with the KV cache: greedy (temperature 0) or seeded sampling with
// temperature, top-k and top-p. When the context is full the window slides: the oldest quarter
// of the block is dropped and the rest is re-encoded into the cache (positions are absolute in
// GPT-2, so cached keys cannot simply be shifted).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/gpt2.h"

namespace ptllm {

struct SampleOptions {
  int tokens = 200;
  float temperature = 1.0f;  // 0: greedy
  int topK = 0;              // 0: off
  float topP = 1.0f;         // 1: off
  uint64_t seed = 1337;
  // Drift sentinel: every this many generated tokens, while a fast path serves inference,
  // recompute the current step on f32 and compare the logits (top-1 and max |diff| against the
  // gate's bound, 1% of mean |logit|); on drift the fast path is demoted for the rest of the
  // run. 0: off (--no-sentinel).
  int sentinelEvery = 256;
  // Greedy runs decoded on the device where the backend can (Gpt2::decodeGreedy: the same
  // tokens, no host round trip per token); false: token by token from the host.
  bool deviceGreedy = true;
};

struct SentinelReport {
  int checks = 0;
  bool demoted = false;
  int demotedAt = -1;  // generated-token index of the failing check
  double lastMaxAbs = 0, lastLimit = 0;
  std::string line;  // the one console line printed on demotion
};

// Picks the next token from logits[V] (softmax with temperature, top-k, top-p).
int32_t sampleToken(const float* logits, int V, const SampleOptions& opt, Rng& rng);

class Generator {
 public:
  explicit Generator(Gpt2& model) : model_(model) {}
  // Generates opt.tokens tokens after `prompt` (non-empty); calls onToken for each as it is
  // produced. Returns the generated ids (without the prompt).
  std::vector<int32_t> generate(const std::vector<int32_t>& prompt, const SampleOptions& opt,
                                const std::function<void(int32_t)>& onToken = {});
  // Full-context tokens currently encoded in the cache (for tests).
  const std::vector<int32_t>& context() const { return context_; }
  int slides() const { return slides_; }
  const SentinelReport& sentinel() const { return sentinel_; }
  // The last generate()'s tokens decoded speculatively (Gpt2::setSpeculativeLanes), the verify
  // steps they took and the most lanes a run had (0, 0, 0: none ran speculatively).
  int speculativeTokens() const { return specTokens_; }
  int speculativeSteps() const { return specSteps_; }
  int speculativeLanes() const { return specLanes_; }

 private:
  void feed(const std::vector<int32_t>& tokens);  // prefill, sliding if needed
  void checkDrift(int generated);
  Gpt2& model_;
  std::vector<int32_t> context_;
  std::vector<float> logits_;
  int slides_ = 0, specTokens_ = 0, specSteps_ = 0, specLanes_ = 0;
  SentinelReport sentinel_;
};

}  // namespace ptllm
