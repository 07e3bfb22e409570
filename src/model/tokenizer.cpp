#include "model/tokenizer.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"

namespace ptllm {

std::vector<char32_t> decodeUtf8(std::string_view s, const std::string& where) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || i + len > s.size()) fail("{}: invalid UTF-8 at byte {}", where, i);
    char32_t cp = len == 1 ? c : c & (0x7F >> len);
    for (int k = 1; k < len; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + k]);
      if ((cc >> 6) != 2) fail("{}: invalid UTF-8 at byte {}", where, i);
      cp = (cp << 6) | (cc & 0x3F);
    }
    static constexpr char32_t kMin[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < kMin[len] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
      fail("{}: invalid UTF-8 at byte {}", where, i);
    out.push_back(cp);
    i += len;
  }
  return out;
}

std::string encodeUtf8(char32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xC0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    s += char(0xE0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  } else {
    s += char(0xF0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3F));
    s += char(0x80 | ((cp >> 6) & 0x3F));
    s += char(0x80 | (cp & 0x3F));
  }
  return s;
}

std::string describeCodePoint(char32_t cp) {
  if (cp >= 0x21 && cp < 0x7F) return fmt::format("'{}'", char(cp));
  return fmt::format("U+{:04X}", uint32_t(cp));
}

CharTokenizer::CharTokenizer(std::vector<char32_t> vocab) : vocab_(std::move(vocab)) {
  for (size_t i = 0; i < vocab_.size(); ++i) index_[vocab_[i]] = int32_t(i);
}

CharTokenizer CharTokenizer::fromText(std::string_view text, const std::string& where) {
  auto cps = decodeUtf8(text, where);
  if (cps.empty()) fail("{}: the text is empty", where);
  std::set<char32_t> distinct(cps.begin(), cps.end());
  return CharTokenizer(std::vector<char32_t>(distinct.begin(), distinct.end()));
}

std::vector<int32_t> CharTokenizer::encode(std::string_view text, const std::string& where) const {
  std::vector<int32_t> ids;
  auto cps = decodeUtf8(text, where);
  ids.reserve(cps.size());
  for (size_t i = 0; i < cps.size(); ++i) {
    auto it = index_.find(cps[i]);
    if (it == index_.end())
      fail("{}: character {} (position {}) is not in the model's vocabulary", where,
           describeCodePoint(cps[i]), i);
    ids.push_back(it->second);
  }
  return ids;
}

std::string CharTokenizer::decode(int32_t token) const {
  PTLLM_ASSERT(token >= 0 && token < size(), "token {} outside vocabulary of {}", token, size());
  return encodeUtf8(vocab_[size_t(token)]);
}

std::string CharTokenizer::decode(const std::vector<int32_t>& tokens) const {
  std::string s;
  for (int32_t t : tokens) s += decode(t);
  return s;
}

std::string CharTokenizer::toJson() const {
  nlohmann::json j;
  j["type"] = "char";
  std::vector<uint32_t> v(vocab_.begin(), vocab_.end());
  j["vocab"] = v;
  return j.dump();
}

CharTokenizer CharTokenizer::fromJson(const std::string& text, const std::string& where) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object())
    fail("{}: tokenizer metadata is not a JSON object", where);
  if (j.value("type", "") != "char") fail("{}: tokenizer type is not \"char\"", where);
  if (!j.contains("vocab") || !j["vocab"].is_array() || j["vocab"].empty())
    fail("{}: tokenizer vocab is missing or empty", where);
  std::vector<char32_t> vocab;
  for (const auto& e : j["vocab"]) {
    // A Unicode scalar value: a code point that is not a UTF-16 surrogate (0xD800..0xDFFF),
    // which UTF-8 cannot encode and decoding never yields.
    if (!e.is_number_unsigned() || e.get<uint64_t>() > 0x10FFFF ||
        (e.get<uint64_t>() >= 0xD800 && e.get<uint64_t>() <= 0xDFFF))
      fail("{}: tokenizer vocab entry {} is not a Unicode scalar value", where, e.dump());
    vocab.push_back(char32_t(e.get<uint32_t>()));
  }
  if (!std::is_sorted(vocab.begin(), vocab.end()) ||
      std::adjacent_find(vocab.begin(), vocab.end()) != vocab.end())
    fail("{}: tokenizer vocab is not sorted and distinct", where);
  return CharTokenizer(std::move(vocab));
}

}  // namespace ptllm
