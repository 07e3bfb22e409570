#include "model/config.h"

#include "core/error.h"

namespace ptllm {

void ModelConfig::validate(const std::string& where) const {
  auto positive = [&](const char* field, int v, int maxv) {
    if (v <= 0 || v > maxv) fail("{}: {} = {} is out of range (1..{})", where, field, v, maxv);
  };
  positive("n_layer", nLayer, 1024);
  positive("n_head", nHead, 1024);
  positive("n_embd", nEmbd, 65536);
  positive("block_size", blockSize, 1 << 20);
  positive("vocab_size", vocabSize, 1 << 24);
  if (nEmbd % nHead != 0)
    fail("{}: n_embd = {} is not divisible by n_head = {}", where, nEmbd, nHead);
}

int64_t ModelConfig::parameterCount() const {
  const int64_t C = nEmbd;
  const int64_t perLayer =
      2 * C + (C * 3 * C + 3 * C) + (C * C + C) + 2 * C + (C * 4 * C + 4 * C) + (4 * C * C + C);
  return int64_t(vocabSize) * C + int64_t(blockSize) * C + nLayer * perLayer + 2 * C;
}

}  // namespace ptllm
