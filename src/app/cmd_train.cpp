// ptllm train: train from scratch, fine-tune (--init) or resume (--resume).
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <cstdio>

#include "app/commands.h"
#include "app/engine.h"
#include "core/error.h"
#include "model/model_gate.h"
#include "model/trainer.h"

namespace ptllm::app {

namespace {

std::atomic<bool> gStop{false};
extern "C" void onSigint(int) {
  gStop.store(true);
}

std::string hms(double s) {
  const int t = int(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02}m", t / 3600, t / 60 % 60)
                   : fmt::format("{}m{:02}s", t / 60, t % 60);
}

void printProgress(const StepReport& r, bool tty, double lastVal) {
  const std::string val = lastVal >= 0 ? fmt::format("{:.4f}", lastVal) : "-";
  if (tty) {
    const int width = 24, filled = int(double(width) * r.step / r.totalSteps);
    std::fprintf(stderr, "\r[%s%s] %d/%d loss %.4f val %s %.0f tok/s ETA %s \x1b[K",
                 std::string(size_t(filled), '#').c_str(),
                 std::string(size_t(width - filled), '.').c_str(), r.step, r.totalSteps,
                 r.trainLoss, val.c_str(), r.tokPerSec, hms(r.etaSec).c_str());
    if (r.step == r.totalSteps) std::fprintf(stderr, "\n");
  } else {
    std::fprintf(stderr, "step %d/%d loss %.4f val %s lr %.3g norm %.3f %.0f tok/s eta %s\n",
                 r.step, r.totalSteps, r.trainLoss, val.c_str(), r.lr, r.gradNorm, r.tokPerSec,
                 hms(r.etaSec).c_str());
  }
  std::fflush(stderr);
}

}  // namespace

void addTrainCommand(CLI::App& app, GlobalOptions& g) {
  auto* cmd = app.add_subcommand("train", "train a character-level GPT-2 on a text file");
  auto o = std::make_shared<TrainOptions>();
  auto logEvery = std::make_shared<int>(10);
  cmd->add_option("--data", o->dataPath, "UTF-8 text file");
  cmd->add_option("--out", o->outPath, "checkpoint to write (.safetensors)");
  cmd->add_option("--init", o->initPath, "fine-tune this checkpoint (uses its tokenizer)");
  cmd->add_option("--resume", o->resumePath, "continue exactly from this checkpoint");
  cmd->add_option("--n-layer", o->model.nLayer, "layers")
      ->capture_default_str()
      ->check(intRange(1));
  cmd->add_option("--n-head", o->model.nHead, "attention heads")
      ->capture_default_str()
      ->check(intRange(1));
  cmd->add_option("--n-embd", o->model.nEmbd, "embedding width")
      ->capture_default_str()
      ->check(intRange(1));
  cmd->add_option("--block-size", o->model.blockSize, "context length")
      ->capture_default_str()
      ->check(intRange(1));
  cmd->add_option("--batch-size", o->batchSize, "sequences per step")
      ->capture_default_str()
      ->check(intRange(1));
  cmd->add_option("--steps", o->steps, "optimisation steps")
      ->capture_default_str()
      ->check(intRange(1));
  cmd->add_option("--lr", o->lr, "peak learning rate")->capture_default_str();
  cmd->add_option("--warmup", o->warmup, "linear warm-up steps")
      ->capture_default_str()
      ->check(intRange(0));
  cmd->add_option("--eval-every", o->evalEvery, "validate every N steps (0: at the end)")
      ->capture_default_str()
      ->check(intRange(0));
  cmd->add_option("--eval-batches", o->evalBatches, "batches per periodic validation")
      ->capture_default_str()
      ->check(intRange(1));
  cmd->add_option("--save-every", o->saveEvery, "checkpoint every N steps (0: at the end)")
      ->capture_default_str()
      ->check(intRange(0));
  cmd->add_option("--seed", o->seed, "random seed (init and batches)")->capture_default_str();
  cmd->add_option("--weight-decay", o->weightDecay, "AdamW weight decay on 2-D weights")
      ->capture_default_str();
  cmd->add_option("--log-every", *logEvery, "print a line every N steps when not on a terminal")
      ->capture_default_str()
      ->check(intRange(1));
  cmd->callback([o, logEvery, &g, cmd] {
    // Options the run would silently ignore are refused: --init takes the model's shape from
    // its checkpoint, and --resume continues the saved run with the saved options.
    const auto given = [&](std::initializer_list<const char*> names) -> std::string {
      for (const char* n : names)
        if (cmd->count(n) > 0) return n;
      return {};
    };
    const std::string shape = given({"--n-layer", "--n-head", "--n-embd", "--block-size"});
    if (!o->initPath.empty() && !o->resumePath.empty())
      fail(
          "train: --init and --resume exclude each other (--resume continues a run; --init "
          "starts a fine-tune)");
    if (!o->initPath.empty() && !shape.empty())
      fail("train: {} cannot be combined with --init {} (the model's shape is the checkpoint's)",
           shape, o->initPath);
    if (!o->resumePath.empty()) {
      const std::string other = given(
          {"--n-layer", "--n-head", "--n-embd", "--block-size", "--batch-size", "--lr", "--warmup",
           "--eval-every", "--eval-batches", "--save-every", "--seed", "--weight-decay"});
      if (!other.empty())
        fail(
            "train: {} cannot be combined with --resume {} (a resumed run keeps its saved "
            "options; only --steps, --out and --data may change)",
            other, o->resumePath);
    }
    g.apply();
    if (!o->resumePath.empty() && cmd->count("--steps") == 0) o->steps = 0;  // keep the saved count
    Engine engine = makeEngine(g);
    Trainer trainer(*engine.ops, *o);
    trainer.model().setPaths(engine.paths.get());
    // The loss gate decides whether the fast path may serve the training forward.
    ModelGate(trainer.model(), &trainer.tokenizer()).apply();
    const auto& opts = trainer.options();
    const auto& c = trainer.model().config();
    std::fprintf(stderr,
                 "train: %s, %d chars vocab, model %d layers %d heads %d embd block %d, %.2fM "
                 "params, batch %d, steps %d (from %d), lr %g\n",
                 opts.dataPath.c_str(), c.vocabSize, c.nLayer, c.nHead, c.nEmbd, c.blockSize,
                 double(trainer.model().numParams()) / 1e6, opts.batchSize, opts.steps,
                 trainer.stepsDone(), double(opts.lr));
    if (trainer.stepsDone() >= opts.steps)
      fail("train: the run already did {} of {} steps; pass a larger --steps", trainer.stepsDone(),
           opts.steps);
    const bool tty = ::isatty(2);
    std::signal(SIGINT, onSigint);
    double lastVal = -1;
    const StepReport last = trainer.run(&gStop, [&](const StepReport& r) {
      if (r.valLoss >= 0) lastVal = r.valLoss;
      if (tty || r.step % *logEvery == 0 || r.valLoss >= 0 || r.step == r.totalSteps)
        printProgress(r, tty, lastVal);
    });
    std::signal(SIGINT, SIG_DFL);
    if (gStop.load()) {
      std::fprintf(stderr, "\ninterrupted: saved step %d to %s (resume with --resume %s)\n",
                   trainer.stepsDone(), opts.outPath.c_str(), opts.outPath.c_str());
      exitCode = 130;
      return;
    }
    std::fprintf(stderr, "done: step %d, train loss %.4f, val loss %.4f, saved %s, log %s\n",
                 last.step, last.trainLoss, last.valLoss, opts.outPath.c_str(),
                 trainer.logPath().c_str());
  });
}

}  // namespace ptllm::app
