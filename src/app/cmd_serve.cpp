// ptllm serve: the local web playground (docs/playground.md). Loads the model, starts the
// gates and the engine worker, then serves the page and its API until Ctrl-C.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <thread>

#include "app/commands.h"
#include "app/engine.h"
#include "app/serve/http_api.h"
#include "app/serve/playground.h"

namespace ptllm::app {

namespace {

std::atomic<bool> gServeStop{false};
extern "C" void onServeSignal(int) {
  gServeStop.store(true);
}

}  // namespace

void addServeCommand(CLI::App& app, GlobalOptions& g) {
  auto* cmd =
      app.add_subcommand("serve", "the local web playground: generate, compare paths, fine-tune");
  struct Args {
    std::string model, host = "127.0.0.1";
    int port = 8080;
    int speculative = Gpt2::kDefaultSpeculativeLanes;
  };
  auto a = std::make_shared<Args>();
  cmd->add_option("--model", a->model, "checkpoint (default: the bundled Shakespeare model)");
  cmd->add_option("--host", a->host, "address to listen on (loopback unless told otherwise)")
      ->capture_default_str();
  cmd->add_option("--port", a->port, "port (0: any free port)")->capture_default_str();
  addSpeculativeOption(cmd, a->speculative,
                       "greedy generations on a GPU: check drafted tokens with this many decode "
                       "steps side by side, unless a request says otherwise (\"speculative\"; "
                       "0: off); the text is the same, bit for bit");
  cmd->callback([a, &g] {
    const std::string path = a->model.empty() ? bundledModelPath() : a->model;
    // Loads the model (errors end here, before listening).
    Playground playground(g, path, {}, a->speculative);
    HttpApi api(playground);
    const int port = api.bind(a->host, a->port);
    std::printf(
        "ptllm serve: listening on http://%s:%d/\n",
        a->host.find(':') != std::string::npos ? ("[" + a->host + "]").c_str() : a->host.c_str(),
        port);
    std::fflush(stdout);
    std::signal(SIGINT, onServeSignal);
    std::signal(SIGTERM, onServeSignal);
    std::thread watcher([&api] {
      while (!gServeStop.load()) std::this_thread::sleep_for(std::chrono::milliseconds(100));
      api.stop();
    });
    const bool ok = api.listen();
    gServeStop.store(true);
    watcher.join();
    std::signal(SIGINT, SIG_DFL);
    std::signal(SIGTERM, SIG_DFL);
    std::fprintf(stderr, "ptllm serve: stopped\n");
    if (!ok) exitCode = 1;
  });
}

}  // namespace ptllm::app
