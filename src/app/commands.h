// The CLI: one file per command (cmd_<name>.cpp), each adding its subcommand to the app.
// Options every command shares live in GlobalOptions.
#pragma once

#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <climits>
#include <string>

#include "kernels/ops.h"

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

// The check of an integer option: accepts lo..hi and otherwise says, in one line, what was typed
// and what is accepted (CLI11's own checks parse as double and print the range's raw limits).
inline CLI::Validator intRange(long long lo, long long hi = INT_MAX) {
  const std::string accepted = hi == INT_MAX ? fmt::format("an integer >= {}", lo)
                                             : fmt::format("an integer from {} to {}", lo, hi);
  return CLI::Validator(
      [lo, hi, accepted](std::string& text) -> std::string {
        size_t used = 0;
        long long v = 0;
        try {
          v = std::stoll(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || v < lo || v > hi)
          return fmt::format("'{}' is not {}", text, accepted);
        return {};
      },
      hi == INT_MAX ? fmt::format("INT>={}", lo) : fmt::format("INT in {}..{}", lo, hi));
}

// Speculative greedy lanes a user may ask for (--speculative, the playground's "speculative";
// Gpt2::setSpeculativeLanes): 0 (off) or 2 up to the backend's most. The error names the
// value as `shown`.
inline constexpr int kMostSpeculativeLanes = Ops::DecodeStepArgs::kMaxSpeculativeLanes;
inline bool speculativeLanesOk(long long lanes) {
  return lanes == 0 || (lanes >= 2 && lanes <= kMostSpeculativeLanes);
}
inline std::string notSpeculativeLanes(const std::string& shown) {
  return fmt::format("{} is not 0 (off) or an integer from 2 to {}", shown, kMostSpeculativeLanes);
}

// --speculative: anything speculativeLanesOk refuses gets a one-line error as intRange gives.
inline CLI::Option* addSpeculativeOption(CLI::App* cmd, int& lanes, const std::string& help) {
  const CLI::Validator range = intRange(0, kMostSpeculativeLanes);
  return cmd->add_option("--speculative", lanes, help)
      ->capture_default_str()
      ->check(CLI::Validator(
          [range](std::string& text) -> std::string {
            if (range(text).empty() && speculativeLanesOk(std::stoll(text))) return {};
            return notSpeculativeLanes("'" + text + "'");
          },
          fmt::format("0 or INT in 2..{}", kMostSpeculativeLanes)));
}

// The most worker threads --threads takes: far above any machine this runs on, far below what
// exhausts a process's threads.
inline constexpr int kMaxThreads = 1024;

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
