// ptllm info: config, parameter count, tensors and metadata of a checkpoint.
#include <cstdio>

#include "app/commands.h"
#include "core/error.h"
#include "core/file_io.h"
#include "model/checkpoint.h"
#include "model/safetensors.h"

namespace ptllm::app {

void addInfoCommand(CLI::App& app, GlobalOptions& /*g*/) {
  auto* cmd = app.add_subcommand("info", "describe a checkpoint");
  auto path = std::make_shared<std::string>();
  cmd->add_option("checkpoint", *path, ".safetensors file or HF directory")->required();
  cmd->callback([path] {
    const std::string file = isDirectory(*path) ? *path + "/model.safetensors" : *path;
    auto f = safetensors::File::open(file);
    std::printf("file: %s (%llu bytes, header %llu bytes)\n", file.c_str(),
                (unsigned long long)f.fileBytes(), (unsigned long long)f.headerBytes());
    std::optional<ModelConfig> cfg;
    if (isDirectory(*path))
      cfg = configFromJson(readTextFile(*path + "/config.json"), *path + "/config.json");
    else if (auto it = f.metadata().find("config"); it != f.metadata().end())
      cfg = configFromJson(it->second, file + ": __metadata__.config");
    if (cfg)
      std::printf(
          "config: n_layer=%d n_head=%d n_embd=%d block_size=%d vocab_size=%d\n"
          "parameters: %lld (%.2fM)\n",
          cfg->nLayer, cfg->nHead, cfg->nEmbd, cfg->blockSize, cfg->vocabSize,
          (long long)cfg->parameterCount(), double(cfg->parameterCount()) / 1e6);
    int64_t stored = 0;
    for (const auto& t : f.tensors()) stored += t.numel;
    std::printf("tensors: %zu (%lld values)\n", f.tensors().size(), (long long)stored);
    for (const auto& t : f.tensors())
      std::printf("  %-32s %-5s %s\n", t.name.c_str(), t.dtypeName.c_str(),
                  shapeString(t.shape).c_str());
    std::printf("metadata:\n");
    for (const auto& [k, v] : f.metadata()) {
      const std::string shown = v.size() > 200 ? v.substr(0, 200) + "..." : v;
      std::printf("  %s: %s\n", k.c_str(), shown.c_str());
    }
  });
}

}  // namespace ptllm::app
