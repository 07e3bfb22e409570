// ptllm: train, fine-tune and sample GPT-2-style models; every fast path is gated.
#include <cstdio>
#include <exception>

#include "app/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{
      "ptllm — train, fine-tune and sample GPT-2-style models; fast paths are gated "
      "against the f32 reference before they activate"};
  app.require_subcommand(1);
  app.fallthrough();  // global options may follow the subcommand
  ptllm::app::GlobalOptions g;
  app.add_option("--threads", g.threads, "worker threads (0: all cores)")
      ->check(ptllm::app::intRange(0, ptllm::app::kMaxThreads));
  app.add_option("--paths", g.paths, "fast paths: auto | f32 | NAME[,NAME]")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            return text.find_first_not_of(" \t") == std::string::npos
                       ? "is empty; expected auto, f32 or path names"
                       : "";
          },
          "auto|f32|NAME[,NAME]"));
  app.add_option("--device", g.device, "cpu | cuda | auto");
  app.add_flag("--regate", g.regate,
               "ignore cached gate verdicts: re-run every gate and rewrite the cache");
  app.add_option("--telemetry-url", g.telemetryUrl,
                 "POST each gate result as JSON to this http:// URL (off by default; also "
                 "$PTLLM_TELEMETRY_URL)");
  ptllm::app::addTrainCommand(app, g);
  ptllm::app::addSampleCommand(app, g);
  ptllm::app::addEvalCommand(app, g);
  ptllm::app::addInfoCommand(app, g);
  ptllm::app::addCapsCommand(app, g);
  ptllm::app::addGateCommand(app, g);
  ptllm::app::addBenchCommand(app, g);
  ptllm::app::addServeCommand(app, g);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    // A bad option is one line, as every other error: what was wrong and where help is.
    std::fprintf(stderr, "ptllm: error: %s (ptllm --help lists the options)\n", e.what());
    return e.get_exit_code();
  } catch (const ptllm::Error& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "ptllm: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "ptllm: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ptllm: error: %s\n", e.what());
    return 1;
  }
  return ptllm::app::exitCode;
}
