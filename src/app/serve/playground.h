// The playground's engine: the ops, the gated paths, the served model and the last fine-tune,
// all owned by ONE worker thread that runs every job. Generation requests run in arrival order;
// while a fine-tune is running the worker does one training step between them, so a request
// never waits for a whole fine-tune. HTTP handlers (http_api.cpp) only validate requests,
// submit jobs and read snapshots; they never touch a model. See docs/playground.md.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "app/commands.h"
#include "app/serve/event_queue.h"
#include "model/sampler.h"

namespace ptllm::app {

struct PlaygroundLimits {
  int maxTokens = 2000;                 // per generation request
  size_t maxPromptChars = 4096;         // code points
  size_t maxTrainTextBytes = 2u << 20;  // fine-tune text
  int maxTrainSteps = 2000;             // per fine-tune
  int maxBatch = 32;                    // fine-tune batch size
  size_t maxQueue = 64;                 // generation requests waiting for the worker
  size_t maxSubscribers = 32;           // /api/events streams
  size_t maxBodyBytes = 4u << 20;       // any request body
  size_t eventQueueCapacity = 256;      // per subscriber; the oldest is dropped past it
};

// A request the API refuses: HTTP status and a one-line message naming the field.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message) : std::runtime_error(message), status_(status) {}
  int status() const { return status_; }

 private:
  int status_;
};

// One generation request. The worker pushes `start`, one `token` per token, then `done` or
// `error` into `events` (an unbounded queue: tokens are never dropped).
struct GenerationJob {
  std::string prompt;
  std::vector<int32_t> promptTokens;
  SampleOptions options;
  bool forceF32 = false;     // "path": "f32"
  int speculativeLanes = 0;  // "speculative": Gpt2::setSpeculativeLanes for this generation
  bool finetuned = false;    // "model": "finetuned"
  bool stream = false;       // "stream": true: the HTTP layer sends the events as they come
  std::atomic<bool> cancelled{false};  // the client went away: stop after the current token
  EventQueue events;
  double submittedAt = 0;  // seconds on the playground's clock
};

class Playground {
 public:
  // Loads the model (errors throw ptllm::Error before anything listens), starts the gates and
  // the worker, which warms up (model-level gates, packing) before it takes jobs.
  // speculativeLanes: a generation's default for "speculative" (serve --speculative).
  Playground(const GlobalOptions& g, const std::string& modelPath, PlaygroundLimits limits = {},
             int speculativeLanes = Gpt2::kDefaultSpeculativeLanes);
  ~Playground();  // stops the worker (a running fine-tune ends unsaved) and every event stream
  Playground(const Playground&) = delete;
  Playground& operator=(const Playground&) = delete;

  const PlaygroundLimits& limits() const { return limits_; }
  EventHub& events() { return hub_; }

  // Snapshots (thread-safe): the JSON objects docs/playground.md describes.
  nlohmann::json info() const;
  nlohmann::json caps();
  nlohmann::json status() const;
  nlohmann::json gates() const;
  nlohmann::json trainStatus() const;
  Event hello();  // the first event of every /api/events stream

  // Validates a /api/generate body and queues the job. Throws ApiError (400, 409, 503).
  std::shared_ptr<GenerationJob> generate(const nlohmann::json& body);
  // Validates a /api/train body; the worker loads the model and the text, then the call returns
  // the train status (202 semantics). Throws ApiError (400, 409, 413).
  nlohmann::json startTraining(const nlohmann::json& body);
  nlohmann::json stopTraining();
  // The last fine-tune's checkpoint file; throws ApiError(404) before one exists.
  std::string checkpointBytes() const;

  // Blocks until the warm-up ended (tests); false on timeout.
  bool waitReady(double timeoutSeconds);

 private:
  struct Core;
  struct Training;
  struct TrainRequest;

  void run();  // the worker
  void warmUp();
  void runGeneration(GenerationJob& job);
  void startTrainingOnWorker(TrainRequest& req);
  void trainOneStep();
  void finishTraining(const std::string& state, const std::string& error);
  void onGateLine(const std::string& line);
  void publishStatus();
  double now() const;
  nlohmann::json statusLocked() const;
  nlohmann::json trainStatusLocked() const;

  PlaygroundLimits limits_;
  int speculativeLanes_;
  EventHub hub_;
  std::unique_ptr<Core> core_;  // engine + models: worker-owned after construction
  std::string modelPath_;
  std::chrono::steady_clock::time_point start_;
  std::string workDir_;  // the server's own temp directory (fine-tune checkpoints)

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::deque<std::shared_ptr<GenerationJob>> queue_;
  std::deque<std::shared_ptr<TrainRequest>> trainRequests_;
  std::vector<std::string> gateLines_;
  nlohmann::json modelGates_;  // null until the model-level gates settled
  nlohmann::json info_;
  nlohmann::json caps_;  // the caps report, computed once the gates settled
  bool ready_ = false;
  double warmupSeconds_ = 0;
  std::string statusLine_ = "warming up…";
  std::string forwardPath_ = "f32";
  std::vector<std::string> pills_;
  std::string warmupError_;
  // Fine-tune state, as /api/train reports it.
  std::string trainState_ = "idle", trainError_;
  nlohmann::json losses_ = nlohmann::json::array();
  nlohmann::json lastStep_;  // the last StepReport as JSON
  int trainSteps_ = 0;
  bool trainRunning_ = false, stopRequested_ = false, hasCheckpoint_ = false;
  std::string trainPath_ = "f32";  // the path the training forward runs on
  std::string checkpointPath_;
  bool stop_ = false;

  std::unique_ptr<Training> training_;  // worker-owned
  std::function<void(const std::string&)> previousSink_;
  std::thread worker_;
};

}  // namespace ptllm::app
