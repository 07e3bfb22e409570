// ptllm eval: loss (nats/token) on the last 10% of a text file, the split train validates on.
#include <cmath>
#include <cstdio>

#include "app/commands.h"
#include "app/engine.h"
#include "core/error.h"
#include "core/file_io.h"
#include "model/checkpoint.h"
#include "model/trainer.h"

namespace ptllm::app {

void addEvalCommand(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("eval", "validation loss of a checkpoint on a text file");
  struct Args {
    std::string model, data;
    int batch = 16;
    bool all = false;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "checkpoint (default: the bundled model)");
  cmd->add_option("--data", a->data, "UTF-8 text file")->required();
  cmd->add_option("--batch-size", a->batch, "windows per forward")
      ->capture_default_str()
      ->check(intRange(1));
  cmd->add_flag("--all", a->all, "evaluate the whole file, not its last 10%");
  cmd->callback([a, &g] {
    g.apply();
    Engine engine = makeEngine(g);
    const std::string path = a->model.empty() ? bundledModelPath() : a->model;
    LoadedModel lm = loadCheckpoint(*engine.ops, path);
    if (!lm.tokenizer) fail("{}: checkpoint has no character tokenizer", path);
    lm.model->setPaths(engine.paths.get());
    const auto tokens = lm.tokenizer->encode(readTextFile(a->data), a->data);
    const auto split = splitTokens(tokens);
    const auto& eval = a->all ? tokens : split.val;
    if (eval.size() < 2)
      fail("{}: {} has {} characters; evaluation needs at least 2 (the whole file has {}{})",
           a->data, a->all ? "the file" : "its last 10%", eval.size(), tokens.size(),
           a->all ? "" : "; --all evaluates all of it");
    const double loss = evaluateLoss(*lm.model, eval, a->batch);
    std::printf("%s: loss %.4f nats/token (%.4f bits) over %zu tokens (%s)\n", a->data.c_str(),
                loss, loss / std::log(2.0), eval.size(), a->all ? "whole file" : "last 10%");
  });
}

}  // namespace ptllm::app
