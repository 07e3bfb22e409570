#include "model/checkpoint.h"

#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "core/error.h"
#include "core/file_io.h"
#include "model/safetensors.h"

namespace ptllm {

namespace st = safetensors;

std::string configToJson(const ModelConfig& c) {
  nlohmann::json j = {{"n_layer", c.nLayer},       {"n_head", c.nHead},
                      {"n_embd", c.nEmbd},         {"block_size", c.blockSize},
                      {"vocab_size", c.vocabSize}, {"architecture", "gpt2"}};
  return j.dump();
}

namespace {

int intField(const nlohmann::json& j, std::initializer_list<const char*> names,
             const std::string& where) {
  for (const char* n : names)
    if (j.contains(n)) {
      const auto& v = j[n];
      if (!v.is_number_integer()) fail("{}: field {} is not an integer: {}", where, n, v.dump());
      const int64_t x = v.get<int64_t>();
      if (x <= 0 || x > (int64_t(1) << 30)) fail("{}: field {} = {} is out of range", where, n, x);
      return int(x);
    }
  fail("{}: missing field {}", where, *names.begin());
}

// "transformer.h.0.attn.c_attn.weight" -> "h.0.attn.c_attn.weight"
std::string canonicalName(const std::string& name) {
  static const std::string kPrefix = "transformer.";
  return name.starts_with(kPrefix) ? name.substr(kPrefix.size()) : name;
}

// Tensors GPT-2 checkpoints carry that the model does not need: the tied head and the
// attention-mask buffers.
bool isIgnorable(const std::string& name) {
  static const std::regex kBuffers(R"(h\.\d+\.attn\.(bias|masked_bias))");
  return name == "lm_head.weight" || std::regex_match(name, kBuffers);
}

// Infers the config from tensor shapes when the file carries none (n_head needs metadata).
ModelConfig inferConfig(const st::File& f, const std::string& where) {
  ModelConfig c;
  const st::TensorInfo* wte = f.find("wte.weight");
  if (!wte) wte = f.find("transformer.wte.weight");
  const st::TensorInfo* wpe = f.find("wpe.weight");
  if (!wpe) wpe = f.find("transformer.wpe.weight");
  if (!wte || !wpe || wte->shape.size() != 2 || wpe->shape.size() != 2)
    fail("{}: no model config in the metadata and no wte/wpe tensors to infer it from", where);
  c.vocabSize = int(wte->shape[0]);
  c.nEmbd = int(wte->shape[1]);
  c.blockSize = int(wpe->shape[0]);
  std::set<int> layers;
  static const std::regex kLayer(R"((?:transformer\.)?h\.(\d+)\..*)");
  for (const auto& t : f.tensors()) {
    std::smatch m;
    if (std::regex_match(t.name, m, kLayer)) layers.insert(std::stoi(m[1]));
  }
  c.nLayer = int(layers.size());
  fail(
      "{}: no model config (n_head) in the metadata; for an HF checkpoint load its directory "
      "(config.json + model.safetensors) (inferred n_layer={}, n_embd={})",
      where, c.nLayer, c.nEmbd);
}

}  // namespace

ModelConfig configFromJson(const std::string& text, const std::string& where) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded() || !j.is_object()) fail("{}: model config is not a JSON object", where);
  ModelConfig c;
  c.nLayer = intField(j, {"n_layer", "num_hidden_layers"}, where);
  c.nHead = intField(j, {"n_head", "num_attention_heads"}, where);
  c.nEmbd = intField(j, {"n_embd", "hidden_size"}, where);
  c.blockSize = intField(j, {"block_size", "n_positions", "n_ctx"}, where);
  c.vocabSize = intField(j, {"vocab_size"}, where);
  c.validate(where);
  return c;
}

LoadedModel loadCheckpoint(Ops& ops, const std::string& path) {
  std::string file = path;
  std::optional<ModelConfig> cfg;
  if (isDirectory(path)) {
    const std::string cfgPath = path + "/config.json";
    file = path + "/model.safetensors";
    if (!fileExists(cfgPath)) fail("{}: directory has no config.json", path);
    if (!fileExists(file)) fail("{}: directory has no model.safetensors", path);
    cfg = configFromJson(readTextFile(cfgPath), cfgPath);
  } else if (!fileExists(path)) {
    fail("{}: no such file", path);
  }
  st::File f = st::File::open(file);
  LoadedModel out;
  out.source = file;
  out.metadata = f.metadata();
  if (!cfg) {
    auto it = out.metadata.find("config");
    cfg = it != out.metadata.end() ? configFromJson(it->second, file + ": __metadata__.config")
                                   : inferConfig(f, file);
  }
  if (auto it = out.metadata.find("tokenizer"); it != out.metadata.end()) {
    out.tokenizer = CharTokenizer::fromJson(it->second, file + ": __metadata__.tokenizer");
    if (out.tokenizer->size() != cfg->vocabSize)
      fail("{}: tokenizer has {} characters but vocab_size is {}", file, out.tokenizer->size(),
           cfg->vocabSize);
  }

  // The config decides what is allocated: every tensor is checked against the layout it
  // describes before anything is, so that a wrong or hostile config (say a block size of 2^20
  // over a small file) is an error here instead of a request for gigabytes.
  const std::vector<ParamInfo> layout = gpt2ParamLayout(*cfg);
  std::map<std::string, const ParamInfo*> byName;
  for (const ParamInfo& p : layout) byName[p.name] = &p;
  std::map<std::string, const st::TensorInfo*> tensorFor;  // layout name -> file tensor
  for (const auto& t : f.tensors()) {
    const std::string name = canonicalName(t.name);
    if (isIgnorable(name)) continue;
    auto it = byName.find(name);
    if (it == byName.end()) fail("{}: unknown tensor {} for a GPT-2 model", file, t.name);
    if (!tensorFor.emplace(name, &t).second) fail("{}: tensor {} appears twice", file, name);
    if (t.shape != it->second->shape)
      fail("{}: tensor {} has shape {}, expected {}", file, t.name, shapeString(t.shape),
           shapeString(it->second->shape));
  }
  for (const ParamInfo& p : layout)
    if (!tensorFor.count(p.name)) fail("{}: missing tensor {}", file, p.name);

  out.model = std::make_unique<Gpt2>(ops, *cfg);
  Gpt2& m = *out.model;
  std::vector<float> host(size_t(m.numParams()), 0.0f);
  for (const ParamInfo& p : layout) {
    const st::TensorInfo& t = *tensorFor.at(p.name);
    float* values = host.data() + p.offset;
    f.readF32Into(t.name, values, size_t(p.numel()));
    for (int64_t i = 0; i < p.numel(); ++i)
      if (!std::isfinite(values[i]))
        fail("{}: tensor {} holds {} at element {}; weights must be finite", file, t.name,
             values[i], i);
  }
  ops.upload(m.paramData(), host.data());
  return out;
}

void saveCheckpoint(Gpt2& model, const CharTokenizer* tokenizer, const std::string& path,
                    const std::map<std::string, std::string>& extra, StoreDType dtype) {
  std::vector<float> host(size_t(model.numParams()));
  model.ops().download(host.data(), model.paramData());
  const st::DType store = dtype == StoreDType::F16    ? st::DType::F16
                          : dtype == StoreDType::BF16 ? st::DType::BF16
                                                      : st::DType::F32;
  std::vector<st::TensorToWrite> tensors;
  for (const auto& p : model.paramInfos())
    tensors.push_back({p.name, p.shape, host.data() + p.offset, store});
  std::map<std::string, std::string> meta = extra;
  meta["format"] = "posttrainllm";
  meta["config"] = configToJson(model.config());
  if (tokenizer) meta["tokenizer"] = tokenizer->toJson();
  st::write(path, tensors, meta);
}

std::string optimizerPathFor(const std::string& checkpointPath) {
  static const std::string kExt = ".safetensors";
  if (checkpointPath.ends_with(kExt))
    return checkpointPath.substr(0, checkpointPath.size() - kExt.size()) + ".optim" + kExt;
  return checkpointPath + ".optim" + kExt;
}

void saveOptimizerState(Gpt2& model, const std::string& path,
                        const std::map<std::string, std::string>& metadata) {
  const size_t n = size_t(model.numParams());
  std::vector<float> m(n), v(n);
  model.ops().download(m.data(), model.adamM());
  model.ops().download(v.data(), model.adamV());
  auto meta = metadata;
  meta["adam_step"] = std::to_string(model.optimizerStep());
  meta["num_params"] = std::to_string(n);
  st::write(path, {{"adam.m", {int64_t(n)}, m.data()}, {"adam.v", {int64_t(n)}, v.data()}}, meta);
}

std::map<std::string, std::string> loadOptimizerState(Gpt2& model, const std::string& path) {
  if (!fileExists(path)) fail("{}: optimizer state not found (needed to resume)", path);
  st::File f = st::File::open(path);
  const auto& meta = f.metadata();
  const size_t n = size_t(model.numParams());
  auto field = [&](const char* k) {
    auto it = meta.find(k);
    if (it == meta.end()) fail("{}: missing metadata field {}", path, k);
    try {
      return std::stoll(it->second);
    } catch (const std::exception&) {
      fail("{}: metadata field {} is not an integer: {}", path, k, it->second);
    }
  };
  if (field("num_params") != int64_t(n))
    fail("{}: optimizer state is for {} parameters, the model has {}", path, field("num_params"),
         n);
  for (const char* name : {"adam.m", "adam.v"}) {
    const auto* t = f.find(name);
    if (!t || t->numel != int64_t(n))
      fail("{}: tensor {} missing or of the wrong size", path, name);
  }
  std::vector<float> host(n);
  f.readF32Into("adam.m", host.data(), n);
  model.ops().upload(model.adamM(), host.data());
  f.readF32Into("adam.v", host.data(), n);
  model.ops().upload(model.adamV(), host.data());
  model.setOptimizerStep(int(field("adam_step")));
  return meta;
}

}  // namespace ptllm
