// Deterministic random numbers whose whole state is one 64-bit word, so a training run can
// save it in a checkpoint and resume bit-exactly. SplitMix64 (Steele, Lea, Flood 2014).
#pragma once

#include <cmath>
#include <cstdint>

namespace ptllm {

class Rng {
 public:
  explicit Rng(uint64_t seed = 0) : state_(seed) {}
  uint64_t state() const { return state_; }
  void setState(uint64_t s) { state_ = s; }

  uint64_t next() {
    uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  // Uniform in [0, 1) with 24 random bits (exactly representable in f32).
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f); }
  double uniformDouble() { return static_cast<double>(next() >> 11) * (1.0 / 9007199254740992.0); }
  float uniform(float lo, float hi) { return lo + (hi - lo) * uniform(); }
  // Uniform integer in [0, n), n > 0 (Lemire's multiply-shift; bias below 2^-32 for n < 2^32).
  uint64_t below(uint64_t n) {
    return static_cast<uint64_t>((static_cast<unsigned __int128>(next()) * n) >> 64);
  }
  // Standard normal (Box-Muller; one of the pair is discarded to keep the state one word).
  float normal() {
    double u1 = uniformDouble(), u2 = uniformDouble();
    if (u1 < 1e-300) u1 = 1e-300;
    return static_cast<float>(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
  }

 private:
  uint64_t state_;
};

}  // namespace ptllm
