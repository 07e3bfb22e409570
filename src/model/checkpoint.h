// Checkpoints: safetensors files with HF GPT-2 tensor names (Conv1D [in,out] layout), the model
// config and the tokenizer in __metadata__. Also loads an HF directory (config.json +
// model.safetensors) and tensors stored as F32, F16 or BF16. Optimizer state (AdamW moments,
// step, data RNG) lives in a separate file next to the checkpoint. All writes are atomic.
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>

#include "kernels/ops.h"
#include "model/gpt2.h"
#include "model/tokenizer.h"

namespace ptllm {

enum class StoreDType { F32, F16, BF16 };

struct LoadedModel {
  std::unique_ptr<Gpt2> model;
  std::optional<CharTokenizer> tokenizer;  // absent for HF checkpoints (BPE is not supported)
  std::map<std::string, std::string> metadata;
  std::string source;  // the file that was read
};

// `path` is a .safetensors file or an HF directory. Errors name the file and the problem.
LoadedModel loadCheckpoint(Ops& ops, const std::string& path);

// Writes weights (+ config, tokenizer and `extra` metadata) atomically.
void saveCheckpoint(Gpt2& model, const CharTokenizer* tokenizer, const std::string& path,
                    const std::map<std::string, std::string>& extra = {},
                    StoreDType dtype = StoreDType::F32);

// The optimizer-state file that belongs to a checkpoint: x.safetensors -> x.optim.safetensors.
std::string optimizerPathFor(const std::string& checkpointPath);
void saveOptimizerState(Gpt2& model, const std::string& path,
                        const std::map<std::string, std::string>& metadata);
// Restores moments and step into `model`; returns the file's metadata.
std::map<std::string, std::string> loadOptimizerState(Gpt2& model, const std::string& path);

std::string configToJson(const ModelConfig& cfg);
ModelConfig configFromJson(const std::string& json, const std::string& where);

}  // namespace ptllm
