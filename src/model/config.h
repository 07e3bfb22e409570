// GPT-2 model configuration.
#pragma once

#include <cstdint>
#include <string>

namespace ptllm {

struct ModelConfig {
  int nLayer = 4;
  int nHead = 4;
  int nEmbd = 256;
  int blockSize = 256;  // maximum context (rows of wpe)
  int vocabSize = 0;

  int headSize() const { return nEmbd / nHead; }
  // Throws ptllm::Error naming the field when the configuration is unusable.
  void validate(const std::string& where) const;
  int64_t parameterCount() const;
};

}  // namespace ptllm
