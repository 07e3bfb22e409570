// The CLI: one file per command (cmd_<name>.cpp), each adding its subcommand to the app.
// Options every command shares live in GlobalOptions.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace ptllm::app {

struct GlobalOptions {
  int threads = 0;              // 0: all hardware threads
  std::string paths = "auto";   // --paths auto|f32|NAME[,NAME]
  std::string device = "auto";  // --device cpu|cuda|auto
  bool regate = false;          // --regate: ignore the gate cache, re-run and rewrite it
  std::string telemetryUrl;     // --telemetry-url URL (else $PTLLM_TELEMETRY_URL; off if empty)
  // Applies threads; called by each command before it runs.
  void apply() const;
};

// Exit status a command sets when it must end non-zero without an error message.
inline int exitCode = 0;

void addTrainCommand(CLI::App& app, GlobalOptions& g);
void addSampleCommand(CLI::App& app, GlobalOptions& g);
void addEvalCommand(CLI::App& app, GlobalOptions& g);
void addInfoCommand(CLI::App& app, GlobalOptions& g);
void addCapsCommand(CLI::App& app, GlobalOptions& g);
void addGateCommand(CLI::App& app, GlobalOptions& g);
void addBenchCommand(CLI::App& app, GlobalOptions& g);
void addServeCommand(CLI::App& app, GlobalOptions& g);
void addCudaBenchSubcommand(CLI::App* bench, GlobalOptions& g);  // `bench cuda`

}  // namespace ptllm::app
