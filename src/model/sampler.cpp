#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "gate/paths.h"

namespace ptllm {

int32_t sampleToken(const float* logits, int V, const SampleOptions& opt, Rng& rng) {
  if (opt.temperature <= 0.0f) return int32_t(std::max_element(logits, logits + V) - logits);
  std::vector<int32_t> idx(static_cast<size_t>(V));
  std::iota(idx.begin(), idx.end(), 0);
  // Highest logits first; ties by id keep it deterministic. A NaN ranks as -inf (never drawn
  // while any logit is finite), which also keeps the order a strict weak ordering that std::sort
  // needs: compared as they are, NaNs would be "equal" to every logit.
  const auto rank = [&](int32_t i) { return std::isnan(logits[i]) ? -INFINITY : logits[i]; };
  std::sort(idx.begin(), idx.end(), [&](int32_t a, int32_t b) {
    const float ra = rank(a), rb = rank(b);
    return ra != rb ? ra > rb : a < b;
  });
  const float top = rank(idx[0]);
  if (top == -INFINITY) fail("sampling: every logit is NaN or -inf; the model's output is broken");
  if (top == INFINITY) return idx[0];  // infinitely more likely than anything finite
  // Only logits above -inf (NaNs rank there) can be drawn: they come first.
  size_t keep = size_t(
      std::partition_point(idx.begin(), idx.end(), [&](int32_t i) { return rank(i) > -INFINITY; }) -
      idx.begin());
  if (opt.topK > 0) keep = std::min(keep, size_t(opt.topK));
  std::vector<double> p(keep);
  const double mx = top;
  double sum = 0;
  for (size_t i = 0; i < keep; ++i)
    sum += (p[i] = std::exp((logits[idx[i]] - mx) / opt.temperature));
  if (opt.topP < 1.0f) {
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      cum += p[n++] / sum;
      if (cum >= opt.topP) break;
    }
    keep = std::max<size_t>(n, 1);
    sum = std::accumulate(p.begin(), p.begin() + long(keep), 0.0);
  }
  double u = rng.uniformDouble() * sum;
  for (size_t i = 0; i < keep; ++i) {
    u -= p[i];
    if (u < 0) return idx[i];
  }
  return idx[keep - 1];
}

void Generator::feed(const std::vector<int32_t>& tokens) {
  const int T = model_.config().blockSize;
  logits_.resize(size_t(model_.config().vocabSize));
  for (int32_t t : tokens) context_.push_back(t);
  if (int(context_.size()) > T) {
    // Slide: keep the newest 3/4 of a block (at least 1 token) and re-encode it.
    const size_t keep = std::max<size_t>(1, size_t(T) - size_t(T) / 4);
    context_.erase(context_.begin(), context_.end() - long(std::min(keep, context_.size())));
    model_.resetCache();
    ++slides_;
    model_.forwardCached(context_.data(), int(context_.size()), logits_.data());
    return;
  }
  const int fresh = int(context_.size()) - model_.cachedTokens();
  model_.forwardCached(context_.data() + model_.cachedTokens(), fresh, logits_.data());
}

void Generator::checkDrift(int generated) {
  const PathEntry* path = model_.fastPath(false);
  if (!path) return;
  const int V = model_.config().vocabSize, n = int(context_.size());
  model_.setForceF32(true);
  model_.forward(context_.data(), nullptr, 1, n);
  model_.setForceF32(false);
  const auto all = model_.logitsHost();
  const float* ref = all.data() + int64_t(n - 1) * V;
  double maxAbs = 0, meanRef = 0;
  for (int v = 0; v < V; ++v) {
    const double d = std::fabs(double(logits_[v]) - ref[v]);
    maxAbs = std::isnan(d) ? INFINITY : std::max(maxAbs, d);
    meanRef += std::fabs(ref[v]) / V;
  }
  const double limit = 0.01 * meanRef;
  const bool sameTop = std::max_element(logits_.begin(), logits_.end()) - logits_.begin() ==
                       std::max_element(ref, ref + V) - ref;
  ++sentinel_.checks;
  sentinel_.lastMaxAbs = maxAbs;
  sentinel_.lastLimit = limit;
  if (sameTop && maxAbs < limit) return;
  // Drift: f32 for the rest of this run; re-encode the context on f32 and continue from it.
  sentinel_.demoted = true;
  sentinel_.demotedAt = generated;
  sentinel_.line = fmt::format(
      "[ops] drift sentinel: {} drifted from f32 at token {} (top-1 {}, max|dlogit|={:.3g}, limit "
      "{:.3g}) — f32 for the rest of this run",
      path->name, generated, sameTop ? "agrees" : "differs", maxAbs, limit);
  gateLog(sentinel_.line);
  model_.setPathUse(model_.pathAllowedInTraining(), false);
  model_.resetCache();
  model_.forwardCached(context_.data(), n, logits_.data());
}

std::vector<int32_t> Generator::generate(const std::vector<int32_t>& prompt,
                                         const SampleOptions& opt,
                                         const std::function<void(int32_t)>& onToken) {
  if (prompt.empty()) fail("generate: the prompt is empty");
  if (opt.tokens < 0) fail("generate: --tokens must be >= 0 (got {})", opt.tokens);
  if (opt.temperature < 0 || !std::isfinite(opt.temperature))
    fail("generate: --temperature must be >= 0 (got {})", opt.temperature);
  if (!(opt.topP > 0.0f && opt.topP <= 1.0f))
    fail("generate: --top-p must be in (0, 1] (got {})", opt.topP);
  if (opt.topK < 0) fail("generate: --top-k must be >= 0 (got {})", opt.topK);
  Rng rng(opt.seed);
  context_.clear();
  slides_ = specTokens_ = specSteps_ = specLanes_ = 0;
  sentinel_ = {};
  model_.resetCache();
  const int T = model_.config().blockSize;
  // A prompt longer than the context keeps its last block.
  std::vector<int32_t> p = prompt;
  if (int(p.size()) > T) p.erase(p.begin(), p.end() - T);
  feed(p);
  std::vector<int32_t> out;
  const int V = model_.config().vocabSize;
  for (int i = 0; i < opt.tokens; ++i) {
    if (opt.sentinelEvery > 0 && i > 0 && i % opt.sentinelEvery == 0 && !sentinel_.demoted)
      checkDrift(i);
    const int32_t next = sampleToken(logits_.data(), V, opt, rng);
    out.push_back(next);
    if (onToken) onToken(next);
    if (i + 1 >= opt.tokens) break;
    // Greedy: a run of steps on the device, each picking the next token itself, up to the token
    // before the next sentinel check, the context's end (the slide stays on the host) or the
    // last token (which the host picks from the run's last logits, as always).
    const int toSentinel = opt.sentinelEvery > 0 && !sentinel_.demoted
                               ? (i / opt.sentinelEvery + 1) * opt.sentinelEvery - i
                               : opt.tokens;
    const int run = std::min({opt.tokens - 1 - i, T - int(context_.size()), toSentinel});
    if (opt.temperature <= 0.0f && opt.deviceGreedy && run >= 2 && model_.canDecodeGreedy()) {
      context_.push_back(next);
      int picked = 0;
      const bool done = model_.decodeGreedy(
          next, run,
          [&](int32_t t) {
            // The last pick is not fed: the host re-picks it from the run's last logits.
            if (++picked == run) return;
            context_.push_back(t);
            out.push_back(t);
            if (onToken) onToken(t);
          },
          logits_.data(), context_.data());
      if (done) {
        specTokens_ += model_.lastSpeculativeTokens();
        specSteps_ += model_.lastSpeculativeSteps();
        specLanes_ = std::max(specLanes_, model_.lastSpeculativeLanes());
        i += run - 1;
        continue;
      }
      context_.pop_back();  // nothing ran: `next` goes the host's way
    }
    feed({next});
  }
  return out;
}

}  // namespace ptllm
