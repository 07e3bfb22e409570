#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/resource.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "core/error.h"
#include "model/safetensors.h"

namespace st = ptllm::safetensors;
namespace fs = std::filesystem;

namespace {

// A fresh directory from mkdtemp, removed with everything in it at the end of the test.
class TempDir {
 public:
  TempDir() {
    std::string base = fs::temp_directory_path().string() + "/ptllm_st_XXXXXX";
    std::vector<char> buf(base.begin(), base.end());
    buf.push_back('\0');
    if (!::mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
    path_ = buf.data();
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string readAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void writeBytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

// A hand-built safetensors file: length prefix (or an override), header text, data bytes.
std::string rawFile(const std::string& header, const std::string& data,
                    std::optional<uint64_t> lenOverride = std::nullopt) {
  return le64(lenOverride ? *lenOverride : header.size()) + header + data;
}

template <typename T>
std::string bytesOf(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

uint32_t bits(float f) {
  return std::bit_cast<uint32_t>(f);
}
float fromBits(uint32_t u) {
  return std::bit_cast<float>(u);
}

// Runs `fn`, expecting a ptllm::Error; returns its message ("" if nothing was thrown).
template <typename Fn>
std::string errorOf(Fn&& fn) {
  try {
    fn();
  } catch (const ptllm::Error& e) {
    return e.what();
  }
  return "";
}

// Opening `path` must throw ptllm::Error with a one-line message naming the file and `keyword`.
void expectOpenFails(const std::string& path, const std::string& keyword) {
  SCOPED_TRACE(path);
  EXPECT_THROW(st::File::open(path), ptllm::Error);
  std::string msg = errorOf([&] { st::File::open(path); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find(keyword), std::string::npos) << "want '" << keyword << "' in: " << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// Conversions

TEST(SafetensorsConvert, F32ToF16HandComputed) {
  EXPECT_EQ(st::f32ToF16(0.0f), 0x0000);
  EXPECT_EQ(st::f32ToF16(-0.0f), 0x8000);
  EXPECT_EQ(st::f32ToF16(1.0f), 0x3c00);
  EXPECT_EQ(st::f32ToF16(-2.0f), 0xc000);
  EXPECT_EQ(st::f32ToF16(0.5f), 0x3800);
  EXPECT_EQ(st::f32ToF16(65504.0f), 0x7bff);  // largest finite
  // Ties round to even: 1 + 2^-11 is halfway between 0x3c00 and 0x3c01 -> 0x3c00.
  EXPECT_EQ(st::f32ToF16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3*2^-11 is halfway between 0x3c01 and 0x3c02 -> 0x3c02.
  EXPECT_EQ(st::f32ToF16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  // Just above a tie rounds up.
  EXPECT_EQ(st::f32ToF16(std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f)), 0x3c01);
  // Overflow: 65519 rounds down to 65504; 65520 is a tie with odd 0x7bff -> inf.
  EXPECT_EQ(st::f32ToF16(65519.0f), 0x7bff);
  EXPECT_EQ(st::f32ToF16(65520.0f), 0x7c00);
  EXPECT_EQ(st::f32ToF16(1e6f), 0x7c00);
  EXPECT_EQ(st::f32ToF16(-1e30f), 0xfc00);
  EXPECT_EQ(st::f32ToF16(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(st::f32ToF16(-std::numeric_limits<float>::infinity()), 0xfc00);
  // Subnormals: value = h * 2^-24.
  EXPECT_EQ(st::f32ToF16(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(st::f32ToF16(std::ldexp(1.0f, -25)), 0x0000);  // tie -> even (0)
  EXPECT_EQ(st::f32ToF16(std::nextafter(std::ldexp(1.0f, -25), 1.0f)), 0x0001);
  EXPECT_EQ(st::f32ToF16(3 * std::ldexp(1.0f, -25)), 0x0002);  // 1.5 -> 2 (even)
  EXPECT_EQ(st::f32ToF16(5 * std::ldexp(1.0f, -25)), 0x0002);  // 2.5 -> 2 (even)
  EXPECT_EQ(st::f32ToF16(std::ldexp(1.0f, -26)), 0x0000);
  EXPECT_EQ(st::f32ToF16(-std::ldexp(1.0f, -24)), 0x8001);
  EXPECT_EQ(st::f32ToF16(1023 * std::ldexp(1.0f, -24)), 0x03ff);     // largest subnormal
  EXPECT_EQ(st::f32ToF16(1023.5f * std::ldexp(1.0f, -24)), 0x0400);  // tie -> min normal
  EXPECT_EQ(st::f32ToF16(std::ldexp(1.0f, -14)), 0x0400);            // min normal
  EXPECT_EQ(st::f32ToF16(std::numeric_limits<float>::denorm_min()), 0x0000);
  // NaN stays NaN (sign kept).
  uint16_t n = st::f32ToF16(std::numeric_limits<float>::quiet_NaN());
  EXPECT_EQ(n & 0x7c00, 0x7c00);
  EXPECT_NE(n & 0x03ff, 0);
  uint16_t nn = st::f32ToF16(fromBits(0xff800001u));  // negative signalling NaN, tiny payload
  EXPECT_EQ(nn & 0xfc00, 0xfc00);
  EXPECT_NE(nn & 0x03ff, 0);
}

TEST(SafetensorsConvert, F16ToF32HandComputed) {
  EXPECT_EQ(bits(st::f16ToF32(0x0000)), bits(0.0f));
  EXPECT_EQ(bits(st::f16ToF32(0x8000)), bits(-0.0f));
  EXPECT_EQ(st::f16ToF32(0x3c00), 1.0f);
  EXPECT_EQ(st::f16ToF32(0xc000), -2.0f);
  EXPECT_EQ(st::f16ToF32(0x7bff), 65504.0f);
  EXPECT_EQ(st::f16ToF32(0x3555), 0.333251953125f);
  EXPECT_EQ(st::f16ToF32(0x0001), std::ldexp(1.0f, -24));
  EXPECT_EQ(st::f16ToF32(0x8001), -std::ldexp(1.0f, -24));
  EXPECT_EQ(st::f16ToF32(0x03ff), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(st::f16ToF32(0x0400), std::ldexp(1.0f, -14));
  EXPECT_EQ(st::f16ToF32(0x7c00), std::numeric_limits<float>::infinity());
  EXPECT_EQ(st::f16ToF32(0xfc00), -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(st::f16ToF32(0x7e00)));
  EXPECT_TRUE(std::isnan(st::f16ToF32(0x7c01)));
  EXPECT_TRUE(std::signbit(st::f16ToF32(0xfe00)));
  // Every non-NaN f16 survives f16 -> f32 -> f16 exactly.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    uint16_t v = static_cast<uint16_t>(h);
    if ((v & 0x7c00) == 0x7c00 && (v & 0x3ff)) {
      EXPECT_TRUE(std::isnan(st::f16ToF32(v)));
      continue;
    }
    ASSERT_EQ(st::f32ToF16(st::f16ToF32(v)), v) << std::hex << h;
  }
}

TEST(SafetensorsConvert, Bf16HandComputed) {
  EXPECT_EQ(st::f32ToBf16(1.0f), 0x3f80);
  EXPECT_EQ(st::f32ToBf16(-2.0f), 0xc000);
  EXPECT_EQ(st::f32ToBf16(0.0f), 0x0000);
  EXPECT_EQ(st::f32ToBf16(-0.0f), 0x8000);
  // 1 + 2^-8 is halfway between 0x3f80 and 0x3f81 -> even 0x3f80.
  EXPECT_EQ(st::f32ToBf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  // 1 + 3*2^-8 is halfway between 0x3f81 and 0x3f82 -> even 0x3f82.
  EXPECT_EQ(st::f32ToBf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(st::f32ToBf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20)), 0x3f81);
  EXPECT_EQ(st::f32ToBf16(std::numeric_limits<float>::max()), 0x7f80);  // rounds to inf
  EXPECT_EQ(st::f32ToBf16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_EQ(st::f32ToBf16(-std::numeric_limits<float>::infinity()), 0xff80);
  EXPECT_EQ(st::f32ToBf16(fromBits(0x00012345u)), 0x0001);  // f32 subnormal
  // NaN with a payload only in the low 16 bits must stay NaN, not become inf.
  uint16_t n = st::f32ToBf16(fromBits(0x7f800001u));
  EXPECT_EQ(n & 0x7f80, 0x7f80);
  EXPECT_NE(n & 0x007f, 0);
  EXPECT_EQ(st::f32ToBf16(fromBits(0xffc00000u)), 0xffc0);
  EXPECT_EQ(st::bf16ToF32(0x3f80), 1.0f);
  EXPECT_EQ(st::bf16ToF32(0x4049), fromBits(0x40490000u));
  EXPECT_EQ(bits(st::bf16ToF32(0x8000)), bits(-0.0f));
  EXPECT_TRUE(std::isnan(st::bf16ToF32(0x7fc0)));
}

TEST(SafetensorsConvert, DTypeNames) {
  EXPECT_STREQ(st::dtypeName(st::DType::F32), "F32");
  EXPECT_STREQ(st::dtypeName(st::DType::F16), "F16");
  EXPECT_STREQ(st::dtypeName(st::DType::BF16), "BF16");
  EXPECT_EQ(st::parseDType("BF16"), st::DType::BF16);
  EXPECT_EQ(st::parseDType("F16"), st::DType::F16);
  EXPECT_EQ(st::parseDType("F32"), st::DType::F32);
  EXPECT_EQ(st::parseDType("I64"), std::nullopt);
  EXPECT_EQ(st::parseDType("f32"), std::nullopt);
  EXPECT_EQ(st::dtypeSize(st::DType::F32), 4u);
  EXPECT_EQ(st::dtypeSize(st::DType::BF16), 2u);
}

// ---------------------------------------------------------------------------------------------
// Round trips

TEST(SafetensorsRoundTrip, F32BitExact) {
  TempDir dir;
  std::vector<float> a = {0.0f,
                          -0.0f,
                          1.0f,
                          -3.5f,
                          std::numeric_limits<float>::denorm_min(),
                          -std::numeric_limits<float>::denorm_min(),
                          fromBits(0x007fffffu),
                          std::numeric_limits<float>::min(),
                          std::numeric_limits<float>::max(),
                          std::numeric_limits<float>::lowest(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          fromBits(0x7fc01234u),
                          fromBits(0xff800001u)};
  std::vector<float> b = {1, 2, 3, 4, 5, 6};
  std::string p = dir.file("f32.safetensors");
  st::write(p, {{"a", {static_cast<int64_t>(a.size())}, a.data()}, {"b.weight", {2, 3}, b.data()}},
            {});
  auto f = st::File::open(p);
  EXPECT_EQ(f.path(), p);
  ASSERT_EQ(f.tensors().size(), 2u);
  auto ra = f.readF32("a");
  ASSERT_EQ(ra.size(), a.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(bits(ra[i]), bits(a[i])) << i;
  const st::TensorInfo* tb = f.find("b.weight");
  ASSERT_NE(tb, nullptr);
  EXPECT_EQ(tb->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(tb->numel, 6);
  EXPECT_EQ(tb->dtypeName, "F32");
  EXPECT_EQ(tb->dtype, st::DType::F32);
  EXPECT_EQ(f.readF32("b.weight"), b);
  std::vector<float> into(6);
  f.readF32Into("b.weight", into.data(), into.size());
  EXPECT_EQ(into, b);
  EXPECT_EQ(f.find("missing"), nullptr);
}

TEST(SafetensorsRoundTrip, F16AndBf16MatchConversions) {
  TempDir dir;
  std::vector<float> v = {0.0f,    -0.0f, 1.0f,  -2.0f, 0.1f,   1.0f + std::ldexp(1.0f, -11),
                          65520.f, 1e-7f, 3e-8f, 1e6f,  -1e-3f, std::nanf(""),
                          3.14159f};
  // Odd count so the F16 tensor leaves the next tensor at an unaligned offset.
  std::string p = dir.file("half.safetensors");
  st::write(p, {{"h", {static_cast<int64_t>(v.size())}, v.data(), st::DType::F16},
                {"b", {static_cast<int64_t>(v.size())}, v.data(), st::DType::BF16},
                {"f", {static_cast<int64_t>(v.size())}, v.data(), st::DType::F32}});
  auto f = st::File::open(p);
  EXPECT_EQ(f.find("h")->dtype, st::DType::F16);
  EXPECT_EQ(f.find("b")->dtypeName, "BF16");
  EXPECT_EQ(f.find("h")->end - f.find("h")->begin, v.size() * 2);
  auto h = f.readF32("h"), b = f.readF32("b"), g = f.readF32("f");
  for (size_t i = 0; i < v.size(); ++i) {
    EXPECT_EQ(bits(h[i]), bits(st::f16ToF32(st::f32ToF16(v[i])))) << i;
    EXPECT_EQ(bits(b[i]), bits(st::bf16ToF32(st::f32ToBf16(v[i])))) << i;
    EXPECT_EQ(bits(g[i]), bits(v[i])) << i;
  }
  EXPECT_EQ(h[2], 1.0f);
  EXPECT_EQ(h[5], 1.0f);  // tie to even
  EXPECT_TRUE(std::isinf(h[6]));
  EXPECT_TRUE(std::isnan(h[11]));
  EXPECT_TRUE(std::isnan(b[11]));
}

TEST(SafetensorsRoundTrip, HandBuiltF16AndBf16Decode) {
  TempDir dir;
  std::vector<uint16_t> h = {0x3c00, 0x0001, 0x7bff, 0xfc00, 0x8000, 0x3555};
  std::vector<uint16_t> b = {0x3f80, 0xc049};
  std::string header = R"({"h":{"dtype":"F16","shape":[2,3],"data_offsets":[0,12]},)"
                       R"("b":{"dtype":"BF16","shape":[2],"data_offsets":[12,16]}})";
  std::string p = dir.file("hand.safetensors");
  writeBytes(p, rawFile(header, bytesOf(h) + bytesOf(b)));
  auto f = st::File::open(p);
  auto rh = f.readF32("h");
  std::vector<float> want = {1.0f,     std::ldexp(1.0f, -24),
                             65504.0f, -std::numeric_limits<float>::infinity(),
                             -0.0f,    0.333251953125f};
  ASSERT_EQ(rh.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(bits(rh[i]), bits(want[i])) << i;
  auto rb = f.readF32("b");
  EXPECT_EQ(rb, (std::vector<float>{1.0f, fromBits(0xc0490000u)}));
}

TEST(SafetensorsRoundTrip, Metadata) {
  TempDir dir;
  std::vector<float> x = {1, 2};
  std::map<std::string, std::string> meta = {{"format", "pt"},
                                             {"config", R"({"n_layer": 12, "quote": "\""})"},
                                             {"unicode", "héllo ✓"},
                                             {"empty", ""}};
  std::string p = dir.file("meta.safetensors");
  st::write(p, {{"x", {2}, x.data()}}, meta);
  auto f = st::File::open(p);
  EXPECT_EQ(f.metadata(), meta);
  EXPECT_EQ(f.find("__metadata__"), nullptr);
  EXPECT_EQ(f.tensors().size(), 1u);

  std::string p2 = dir.file("nometa.safetensors");
  st::write(p2, {{"x", {2}, x.data()}});
  EXPECT_TRUE(st::File::open(p2).metadata().empty());
  EXPECT_EQ(readAll(p2).find("__metadata__"), std::string::npos);
}

TEST(SafetensorsRoundTrip, WriterLayoutAndOrder) {
  TempDir dir;
  std::vector<float> a(5, 1.5f), s = {42.0f}, c(7, -2.0f);
  std::string p = dir.file("layout.safetensors");
  // Deliberately not alphabetical; includes a scalar and an empty tensor.
  st::write(p, {{"zeta", {5}, a.data(), st::DType::F16},
                {"alpha", {}, s.data()},
                {"empty", {0, 4}, nullptr},
                {"mid", {7, 1}, c.data(), st::DType::BF16}});
  std::string raw = readAll(p);
  ASSERT_GE(raw.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i)
    n = (n << 8) | static_cast<unsigned char>(raw[static_cast<size_t>(i)]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_LE(8 + n, raw.size());
  std::string header = raw.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  size_t last = header.find_last_not_of(' ');
  EXPECT_EQ(header[last], '}');
  EXPECT_LT(header.size() - 1 - last, 8u);  // only padding after the object
  EXPECT_EQ(raw.size(), 8 + n + 5 * 2 + 4 + 0 + 7 * 2);

  auto f = st::File::open(p);
  EXPECT_EQ(f.headerBytes(), n);
  EXPECT_EQ(f.fileBytes(), raw.size());
  const auto& t = f.tensors();
  ASSERT_EQ(t.size(), 4u);
  EXPECT_EQ(t[0].name, "zeta");
  EXPECT_EQ(t[0].begin, 0u);
  EXPECT_EQ(t[0].end, 10u);
  EXPECT_EQ(t[1].name, "alpha");
  EXPECT_EQ(t[1].begin, 10u);
  EXPECT_EQ(t[1].end, 14u);
  EXPECT_TRUE(t[1].shape.empty());
  EXPECT_EQ(t[1].numel, 1);
  EXPECT_EQ(t[2].name, "empty");
  EXPECT_EQ(t[2].begin, 14u);
  EXPECT_EQ(t[2].end, 14u);
  EXPECT_EQ(t[2].numel, 0);
  EXPECT_EQ(t[3].name, "mid");
  EXPECT_EQ(t[3].begin, 14u);
  EXPECT_EQ(t[3].end, 28u);
  EXPECT_EQ(f.readF32("alpha"), s);
  EXPECT_EQ(f.readF32("zeta"), a);
  EXPECT_EQ(f.readF32("mid"), c);
  EXPECT_TRUE(f.readF32("empty").empty());
}

TEST(SafetensorsRoundTrip, LargeTensorChunkedConversion) {
  TempDir dir;
  std::vector<float> v(200003);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i % 1000) * 0.25f - 100.0f;
  std::string p = dir.file("big.safetensors");
  st::write(p, {{"h", {static_cast<int64_t>(v.size())}, v.data(), st::DType::F16},
                {"b", {static_cast<int64_t>(v.size())}, v.data(), st::DType::BF16}});
  auto f = st::File::open(p);
  auto h = f.readF32("h"), b = f.readF32("b");
  for (size_t i = 0; i < v.size(); ++i) {
    ASSERT_EQ(h[i], v[i]) << i;  // multiples of 0.25 below 250 are exact in f16
    ASSERT_EQ(bits(b[i]), bits(st::bf16ToF32(st::f32ToBf16(v[i])))) << i;
  }
}

// ---------------------------------------------------------------------------------------------
// Reader errors

TEST(SafetensorsRead, UnsupportedDtypeAndMissingTensor) {
  TempDir dir;
  std::string header = R"({"ids":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
                       R"("mask":{"dtype":"BOOL","shape":[3],"data_offsets":[16,19]},)"
                       R"("w":{"dtype":"F32","shape":[1],"data_offsets":[20,24]}})";
  std::string p = dir.file("ints.safetensors");
  writeBytes(p, rawFile(header, std::string(24, '\0')));
  auto f = st::File::open(p);  // known-but-unsupported dtypes open fine
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.find("ids")->dtype, std::nullopt);
  EXPECT_EQ(f.find("ids")->dtypeName, "I64");
  EXPECT_EQ(f.readF32("w"), std::vector<float>{0.0f});  // gap at [19, 20) is tolerated
  EXPECT_THROW(f.readF32("ids"), ptllm::Error);
  std::string msg = errorOf([&] { f.readF32("ids"); });
  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  EXPECT_NE(msg.find("'ids'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("I64"), std::string::npos) << msg;
  EXPECT_NE(msg.find("unsupported"), std::string::npos) << msg;
  msg = errorOf([&] { f.readF32("mask"); });
  EXPECT_NE(msg.find("BOOL"), std::string::npos) << msg;
  msg = errorOf([&] { f.readF32("nope"); });
  EXPECT_NE(msg.find("no tensor named 'nope'"), std::string::npos) << msg;
  float one = 0;
  msg = errorOf([&] { f.readF32Into("w", &one, 2); });
  EXPECT_NE(msg.find("elements"), std::string::npos) << msg;
}

TEST(SafetensorsRead, NotAFile) {
  TempDir dir;
  expectOpenFails(dir.file("does_not_exist.safetensors"), "cannot open");
  expectOpenFails(dir.path(), "not a regular file");
}

struct BadCase {
  const char* name;
  std::string bytes;
  const char* keyword;
};

std::string entry(const std::string& name, const std::string& body) {
  return "\"" + name + "\":" + body;
}

TEST(SafetensorsRead, MalformedFilesGiveOneLineErrors) {
  const std::string ok = R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
  const std::string d8(8, '\0');
  std::string deep = "{\"a\":" + std::string(100000, '[') + std::string(100000, ']') + "}";
  std::vector<BadCase> cases = {
      {"empty", "", "too short"},
      {"short", std::string("\x05\0\0\0\0", 5), "too short"},
      {"len_past_end", rawFile("{}", "", 1000), "past the end of the file"},
      {"len_absurd", rawFile("{}", "", uint64_t{1} << 63), "too large"},
      {"len_over_cap", rawFile("{}", "", 200ull << 20), "too large"},
      {"empty_header", rawFile("", ""), "not valid JSON"},
      {"not_json", rawFile("{abc", ""), "not valid JSON"},
      {"trailing_garbage", rawFile("{} x", ""), "not valid JSON"},
      {"truncated_json", rawFile(R"({"a":{"dtype":"F3)", ""), "not valid JSON"},
      {"not_object", rawFile("[1,2]", ""), "not a JSON object"},
      {"string_header", rawFile("\"hi\"", ""), "not a JSON object"},
      {"bad_utf8", rawFile("{\"a\xff\":1}", ""), "not valid UTF-8"},
      {"overlong_utf8", rawFile("{\"a\xc0\xaf\":1}", ""), "not valid UTF-8"},
      {"surrogate_utf8", rawFile("{\"a\xed\xa0\x80\":1}", ""), "not valid UTF-8"},
      {"cut_utf8", rawFile("{\"a\":1}\xe2\x82", ""), "not valid UTF-8"},
      {"deep_nesting", rawFile(deep, ""), "nested too deeply"},
      {"entry_not_object", rawFile("{" + entry("w", "[1]") + "}", d8), "must be an object"},
      {"missing_dtype", rawFile(R"({"w":{"shape":[2],"data_offsets":[0,8]}})", d8),
       "missing \"dtype\""},
      {"missing_shape", rawFile(R"({"w":{"dtype":"F32","data_offsets":[0,8]}})", d8),
       "missing \"shape\""},
      {"missing_offsets", rawFile(R"({"w":{"dtype":"F32","shape":[2]}})", d8),
       "missing \"data_offsets\""},
      {"dtype_number", rawFile(R"({"w":{"dtype":4,"shape":[2],"data_offsets":[0,8]}})", d8),
       "dtype must be a string"},
      {"dtype_unknown", rawFile(R"({"w":{"dtype":"Q4","shape":[2],"data_offsets":[0,8]}})", d8),
       "unknown dtype 'Q4'"},
      {"shape_string", rawFile(R"({"w":{"dtype":"F32","shape":"2","data_offsets":[0,8]}})", d8),
       "shape must be an array"},
      {"shape_object", rawFile(R"({"w":{"dtype":"F32","shape":{},"data_offsets":[0,8]}})", d8),
       "shape must be an array"},
      {"dim_negative", rawFile(R"({"w":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", d8),
       "negative"},
      {"dim_float", rawFile(R"({"w":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", d8),
       "not an integer"},
      {"dim_float_whole",
       rawFile(R"({"w":{"dtype":"F32","shape":[2.0],"data_offsets":[0,8]}})", d8),
       "not an integer"},
      {"dim_string", rawFile(R"({"w":{"dtype":"F32","shape":["2"],"data_offsets":[0,8]}})", d8),
       "must be an integer"},
      {"dim_null", rawFile(R"({"w":{"dtype":"F32","shape":[null],"data_offsets":[0,8]}})", d8),
       "must be an integer"},
      {"dim_huge",
       rawFile(R"({"w":{"dtype":"F32","shape":[18446744073709551615],"data_offsets":[0,8]}})", d8),
       "too large"},
      {"dim_beyond_u64",
       rawFile(R"({"w":{"dtype":"F32","shape":[1e30],"data_offsets":[0,8]}})", d8),
       "not an integer"},
      {"shape_overflow",
       rawFile(
           R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}})",
           d8),
       "overflows"},
      {"bytes_overflow",
       rawFile(R"({"w":{"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]}})", d8),
       "overflows"},
      {"offsets_one", rawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", d8),
       "[begin, end]"},
      {"offsets_three", rawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8,8]}})", d8),
       "[begin, end]"},
      {"offsets_object", rawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":{"a":0}}})", d8),
       "[begin, end]"},
      {"offsets_negative",
       rawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[-8,0]}})", d8), "negative"},
      {"offsets_float", rawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8.5]}})", d8),
       "not an integer"},
      {"offsets_reversed", rawFile(R"({"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", d8),
       "begin 8 > end 0"},
      {"offsets_past_data",
       rawFile(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", d8),
       "past the end of the data area"},
      {"offsets_huge",
       rawFile(
           R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551608,18446744073709551615]}})",
           d8),
       "past the end of the data area"},
      {"truncated_data", rawFile("{" + entry("w", ok) + "}", std::string(5, '\0')), "truncated"},
      {"size_mismatch", rawFile(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", d8),
       "size mismatch"},
      {"size_mismatch_f16",
       rawFile(R"({"w":{"dtype":"F16","shape":[2],"data_offsets":[0,8]}})", d8), "size mismatch"},
      {"overlap",
       rawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
               std::string(12, '\0')),
       "overlap"},
      {"overlap_contained",
       rawFile(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
               R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
               std::string(16, '\0')),
       "overlap"},
      {"overlap_identical",
       rawFile(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
               R"("b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})",
               d8),
       "overlap"},
      {"duplicate_name", rawFile("{" + entry("w", ok) + "," + entry("w", ok) + "}", d8),
       "duplicate key 'w'"},
      {"duplicate_field",
       rawFile(R"({"w":{"dtype":"F32","dtype":"F16","shape":[2],"data_offsets":[0,8]}})", d8),
       "duplicate key 'dtype'"},
      {"duplicate_metadata", rawFile(R"({"__metadata__":{"k":"a","k":"b"}})", ""),
       "duplicate key 'k'"},
      {"metadata_string", rawFile(R"({"__metadata__":"x"})", ""), "__metadata__"},
      {"metadata_array", rawFile(R"({"__metadata__":["a","b"]})", ""), "__metadata__"},
      {"metadata_number_value", rawFile(R"({"__metadata__":{"k":1}})", ""), "__metadata__"},
      {"metadata_nested_value", rawFile(R"({"__metadata__":{"k":{"x":"y"}}})", ""), "__metadata__"},
      {"empty_name", rawFile("{" + entry("", ok) + "}", d8), "empty name"},
      {"newline_name", rawFile(R"({"a\nb":{"shape":[2],"data_offsets":[0,8]}})", d8),
       "'a\\x0ab' is missing"},
  };
  TempDir dir;
  for (const auto& c : cases) {
    std::string p = dir.file(std::string(c.name) + ".safetensors");
    writeBytes(p, c.bytes);
    expectOpenFails(p, c.keyword);
  }
}

// Every truncation and many single-byte corruptions of a valid file either open (and then read)
// cleanly or throw ptllm::Error: no crash, hang or other exception type.
TEST(SafetensorsRead, CorruptionNeverCrashes) {
  TempDir dir;
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  std::string good = dir.file("good.safetensors");
  st::write(good, {{"a", {2, 3}, x.data()}, {"b", {3}, x.data(), st::DType::F16}}, {{"k", "v"}});
  const std::string raw = readAll(good);
  // A fresh name per case (then removed): rewriting one file with O_TRUNC makes ext4 flush it
  // on every close, which is slow.
  int serial = 0;
  auto place = [&](const std::string& bytes) {
    std::string p = dir.file("bad" + std::to_string(serial++) + ".safetensors");
    writeBytes(p, bytes);
    return p;
  };
  auto tryAll = [&](const std::string& bytes) {
    std::string p = place(bytes);
    try {
      auto f = st::File::open(p);
      for (const auto& t : f.tensors())
        if (t.dtype) f.readF32(t.name);
    } catch (const ptllm::Error& e) {
      std::string msg = e.what();
      EXPECT_NE(msg.find(p), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
    fs::remove(p);
  };
  for (size_t len = 0; len < raw.size(); ++len) {
    std::string p = place(raw.substr(0, len));
    EXPECT_THROW(st::File::open(p), ptllm::Error) << "length " << len;
    fs::remove(p);
  }
  const unsigned char repl[] = {0x00, 0x22, 0x2d, 0x5d, 0x7d, 0x39, 0xff};
  for (size_t i = 0; i < raw.size(); ++i)
    for (unsigned char r : repl) {
      std::string bad = raw;
      bad[i] = static_cast<char>(r);
      tryAll(bad);
    }
}

// ---------------------------------------------------------------------------------------------
// Writer errors

TEST(SafetensorsWrite, MissingDirectoryIsAnError) {
  TempDir dir;
  std::vector<float> x = {1};
  std::string p = dir.file("no/such/dir/out.safetensors");
  EXPECT_THROW(st::write(p, {{"x", {1}, x.data()}}), ptllm::Error);
  std::string msg = errorOf([&] { st::write(p, {{"x", {1}, x.data()}}); });
  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(p));
}

TEST(SafetensorsWrite, InvalidInputLeavesPreviousFileIntact) {
  TempDir dir;
  std::vector<float> x = {1, 2, 3};
  std::string p = dir.file("keep.safetensors");
  st::write(p, {{"x", {3}, x.data()}});
  const std::string before = readAll(p);
  struct Bad {
    std::vector<st::TensorToWrite> tensors;
    std::map<std::string, std::string> meta;
    const char* keyword;
  };
  std::vector<Bad> bad = {
      {{{"x", {3}, x.data()}, {"x", {3}, x.data()}}, {}, "duplicate"},
      {{{"", {3}, x.data()}}, {}, "empty name"},
      {{{"__metadata__", {3}, x.data()}}, {}, "__metadata__"},
      {{{"x", {-1}, x.data()}}, {}, "negative"},
      {{{"x", {1 << 30, 1 << 30, 1 << 30}, x.data()}}, {}, "overflows"},
      {{{"x", {3}, nullptr}}, {}, "no data"},
      {{{"x", {3}, x.data()}}, {{"k", "bad\xff utf8"}}, "UTF-8"},
      {{{"bad\xc3", {3}, x.data()}}, {}, "UTF-8"},
  };
  for (const auto& b : bad) {
    std::string msg = errorOf([&] { st::write(p, b.tensors, b.meta); });
    EXPECT_NE(msg.find(p), std::string::npos) << msg;
    EXPECT_NE(msg.find(b.keyword), std::string::npos) << "want '" << b.keyword << "': " << msg;
    EXPECT_EQ(readAll(p), before);
  }
  EXPECT_EQ(st::File::open(p).readF32("x"), x);
  // Nothing but the original file in the directory (no temp files left behind).
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1u);
}

// A real I/O failure in the middle of the data (file size limit) leaves the old file intact.
TEST(SafetensorsWrite, FailureMidwayLeavesPreviousFileIntact) {
  TempDir dir;
  std::vector<float> small = {7, 8, 9};
  std::string p = dir.file("model.safetensors");
  st::write(p, {{"w", {3}, small.data()}}, {{"step", "1"}});
  const std::string before = readAll(p);

  std::vector<float> big(1 << 20, 0.5f);  // 4 MiB
  struct rlimit old {};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  struct rlimit lim = old;
  lim.rlim_cur = 64 * 1024;
  auto oldHandler = ::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  std::string msg = errorOf([&] { st::write(p, {{"w", {1 << 20}, big.data()}}, {{"step", "2"}}); });
  ::setrlimit(RLIMIT_FSIZE, &old);
  ::signal(SIGXFSZ, oldHandler);

  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  EXPECT_NE(msg.find("write failed"), std::string::npos) << msg;
  EXPECT_EQ(readAll(p), before);
  auto f = st::File::open(p);
  EXPECT_EQ(f.metadata().at("step"), "1");
  EXPECT_EQ(f.readF32("w"), small);
  size_t entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 1u);
}

TEST(SafetensorsWrite, OverwriteReplacesAtomically) {
  TempDir dir;
  std::vector<float> a = {1, 2}, b = {3, 4, 5};
  std::string p = dir.file("m.safetensors");
  st::write(p, {{"a", {2}, a.data()}});
  auto old = st::File::open(p);  // an open File keeps reading the old inode
  st::write(p, {{"b", {3}, b.data(), st::DType::BF16}});
  EXPECT_EQ(old.readF32("a"), a);
  auto f = st::File::open(p);
  EXPECT_EQ(f.find("a"), nullptr);
  EXPECT_EQ(f.readF32("b"), b);
}

}  // namespace
