// Character-level tokenizer: the vocabulary is the sorted set of distinct Unicode code points
// of the training text; token id = index in that list. Stored in checkpoint metadata.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace ptllm {

// Decodes UTF-8; throws ptllm::Error naming `where` and the byte offset of invalid input.
std::vector<char32_t> decodeUtf8(std::string_view text, const std::string& where);
std::string encodeUtf8(char32_t cp);

class CharTokenizer {
 public:
  CharTokenizer() = default;
  explicit CharTokenizer(std::vector<char32_t> vocab);  // sorted, distinct
  static CharTokenizer fromText(std::string_view text, const std::string& where);

  int size() const { return static_cast<int>(vocab_.size()); }
  bool empty() const { return vocab_.empty(); }
  const std::vector<char32_t>& vocab() const { return vocab_; }
  // Throws ptllm::Error naming `where` and the first character the vocabulary lacks.
  std::vector<int32_t> encode(std::string_view text, const std::string& where) const;
  std::string decode(int32_t token) const;
  std::string decode(const std::vector<int32_t>& tokens) const;

  std::string toJson() const;  // {"type":"char","vocab":[10,32,...]}
  static CharTokenizer fromJson(const std::string& json, const std::string& where);

 private:
  std::vector<char32_t> vocab_;
  std::unordered_map<char32_t, int32_t> index_;
};

// Human-readable name of a code point for error messages: 'x' or U+00E9.
std::string describeCodePoint(char32_t cp);

}  // namespace ptllm
