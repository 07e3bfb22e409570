// ptllm sample: stream generated text to stdout; gate lines and the status line go to stderr.
#include <chrono>
#include <cstdio>

#include "app/caps_report.h"
#include "app/commands.h"
#include "app/engine.h"
#include "core/error.h"
#include "model/checkpoint.h"
#include "model/model_gate.h"
#include "model/sampler.h"

namespace ptllm::app {

void addSampleCommand(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("sample", "generate text from a checkpoint");
  struct Args {
    std::string model, prompt = "\n";
    SampleOptions s;
    int speculative = Gpt2::kDefaultSpeculativeLanes;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "checkpoint (default: the bundled Shakespeare model)");
  cmd->add_option("--prompt", a->prompt, "text to continue");
  cmd->add_option("--tokens", a->s.tokens, "characters to generate")->capture_default_str();
  cmd->add_option("--temperature", a->s.temperature, "0: greedy")->capture_default_str();
  cmd->add_option("--top-k", a->s.topK, "keep the k most likely (0: off)")->capture_default_str();
  cmd->add_option("--top-p", a->s.topP, "nucleus sampling mass (1: off)")->capture_default_str();
  cmd->add_option("--seed", a->s.seed, "sampling seed")->capture_default_str();
  addSpeculativeOption(cmd, a->speculative,
                       "greedy on a GPU: check drafted tokens with this many decode steps side "
                       "by side (0: off; a GPU that holds fewer at once runs as many as it holds, "
                       "at least 2); the text is the same, bit for bit");
  auto noSentinel = std::make_shared<bool>(false);
  cmd->add_flag("--no-sentinel", *noSentinel, "no f32 drift checks every 256 tokens");
  cmd->callback([a, noSentinel, &g] {
    if (*noSentinel) a->s.sentinelEvery = 0;
    g.apply();
    const auto t0 = std::chrono::steady_clock::now();
    Engine engine = makeEngine(g);  // gates start now, in the background
    const std::string path = a->model.empty() ? bundledModelPath() : a->model;
    LoadedModel lm = loadCheckpoint(*engine.ops, path);
    if (!lm.tokenizer)
      fail("{}: checkpoint has no character tokenizer; cannot encode a prompt", path);
    const auto prompt = lm.tokenizer->encode(a->prompt, "--prompt");
    if (prompt.empty()) fail("--prompt is empty");
    Gpt2& model = *lm.model;
    model.setPaths(engine.paths.get());
    model.setSpeculativeLanes(a->speculative);
    ModelGate modelGate(model, &*lm.tokenizer);  // end-to-end + loss gates, in the background
    model.prepareForInference();  // waits for the matmul gate, packs weights for the active path
    modelGate.apply();            // waits for the model gates; demotes the path if they failed
    model.prepareForInference();
    const double warm =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    // The path inference really runs on: the model-level gates may have demoted it.
    std::fprintf(stderr, "%s\n", statusLine(warm, model.fastPath(false)).c_str());
    std::fputs(a->prompt.c_str(), stdout);
    Generator gen(model);
    const auto out = gen.generate(prompt, a->s, [&](int32_t t) {
      std::fputs(lm.tokenizer->decode(t).c_str(), stdout);
      std::fflush(stdout);
    });
    std::fputs("\n", stdout);
    if (gen.speculativeSteps() > 0)
      std::fprintf(stderr,
                   "[sample] speculative greedy (%d lanes): %d of %zu tokens in %d verify steps, "
                   "%.2f per step\n",
                   gen.speculativeLanes(), gen.speculativeTokens(), out.size(),
                   gen.speculativeSteps(),
                   double(gen.speculativeTokens()) / gen.speculativeSteps());
  });
}

}  // namespace ptllm::app
