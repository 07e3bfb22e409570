#include "app/serve/playground.h"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <future>
#include <utility>

#include "app/caps_report.h"
#include "app/engine.h"
#include "core/error.h"
#include "core/file_io.h"
#include "gate/paths.h"
#include "model/checkpoint.h"
#include "model/model_gate.h"
#include "model/trainer.h"

namespace ptllm::app {

namespace {

constexpr std::chrono::seconds kTrainStartTimeout{120};

// Thrown from a generation's token callback when its client went away.
struct Cancelled {};

// Reads one optional field of a request body, checking its JSON type and range; `seen`
// collects the names so unknown fields can be rejected.
class Fields {
 public:
  explicit Fields(const nlohmann::json& body) : body_(body) {
    if (!body_.is_object()) throw ApiError(400, "the request body must be a JSON object");
  }
  template <typename T>
  T get(const std::string& name, T fallback) {
    seen_.push_back(name);
    auto it = body_.find(name);
    if (it == body_.end() || it->is_null()) return fallback;
    if constexpr (std::is_same_v<T, bool>) {
      if (!it->is_boolean()) throw ApiError(400, name + ": expected true or false");
    } else if constexpr (std::is_same_v<T, std::string>) {
      if (!it->is_string()) throw ApiError(400, name + ": expected a string");
    } else if constexpr (std::is_integral_v<T>) {
      if (!it->is_number_integer()) throw ApiError(400, name + ": expected an integer");
      if (std::is_unsigned_v<T> && !it->is_number_unsigned() && it->get<int64_t>() < 0)
        throw ApiError(400, name + ": expected a non-negative integer");
      // The value as JSON holds it (up to 64 bits), checked against T before any conversion:
      // 4294967297 must not arrive as 1.
      const bool fits = it->is_number_unsigned() ? std::in_range<T>(it->get<uint64_t>())
                                                 : std::in_range<T>(it->get<int64_t>());
      if (!fits) throw ApiError(400, fmt::format("{}: {} is out of range", name, it->dump()));
    } else {
      if (!it->is_number()) throw ApiError(400, name + ": expected a number");
    }
    return it->get<T>();
  }
  template <typename T>
  T number(const std::string& name, T fallback, T lo, T hi) {
    const T v = get<T>(name, fallback);
    if (!(v >= lo && v <= hi))  // also rejects NaN
      throw ApiError(400, fmt::format("{}: {} is out of range [{}, {}]", name, v, lo, hi));
    return v;
  }
  void rejectUnknown() const {
    for (const auto& [key, value] : body_.items())
      if (std::find(seen_.begin(), seen_.end(), key) == seen_.end())
        throw ApiError(400, fmt::format("unknown field \"{}\"", key));
  }

 private:
  const nlohmann::json& body_;
  std::vector<std::string> seen_;
};

std::string makeWorkDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp && *tmp ? tmp : "/tmp") + "/ptllm-serve.XXXXXX";
  if (!::mkdtemp(tmpl.data())) fail("serve: cannot create a work directory under {}", tmpl);
  return tmpl;
}

std::string pathName(const PathEntry* p) {
  return p ? p->name : "f32";
}

}  // namespace

// The engine and the served model (worker-owned once the worker runs).
struct Playground::Core {
  app::Engine engine;
  LoadedModel base;
  ModelGateReport baseGates;
};

// The current (or last) fine-tune: its trainer owns the fine-tuned model.
struct Playground::Training {
  std::unique_ptr<Trainer> trainer;
  bool finished = false;  // done or stopped: the model serves "finetuned" requests
};

// A /api/train request handed to the worker, which answers through `result`.
struct Playground::TrainRequest {
  TrainOptions options;
  // The answer: HTTP status (0: started) and message. A plain value, not an exception_ptr:
  // exceptions shared across threads are refcounted where ThreadSanitizer cannot see it.
  struct Answer {
    int status = 0;
    std::string error;
  };
  std::promise<Answer> result;
  void refuse(int status, const std::string& error) { result.set_value({status, error}); }
};

Playground::Playground(const GlobalOptions& g, const std::string& modelPath,
                       PlaygroundLimits limits, int speculativeLanes)
    : limits_(limits),
      speculativeLanes_(speculativeLanes),
      hub_(limits.maxSubscribers, limits.eventQueueCapacity),
      modelPath_(modelPath),
      start_(std::chrono::steady_clock::now()) {
  // Every gate line (matmul gates, model-level gates, sentinel demotions) reaches the page too.
  previousSink_ = setGateLogSink([this](const std::string& line) {
    std::fprintf(stderr, "%s\n", line.c_str());
    onGateLine(line);
  });
  try {
    g.apply();
    core_ = std::make_unique<Core>();
    core_->engine = makeEngine(g);  // the gates start now, in the background
    core_->base = loadCheckpoint(*core_->engine.ops, modelPath);
    if (!core_->base.tokenizer)
      fail("{}: checkpoint has no character tokenizer; the playground cannot encode prompts",
           modelPath);
    workDir_ = makeWorkDir();
  } catch (...) {
    core_.reset();
    setGateLogSink(previousSink_);
    throw;
  }
  const ModelConfig& c = core_->base.model->config();
  const Capabilities& caps = core_->engine.paths->capabilities();
  info_ = {{"model",
            {{"name", std::filesystem::path(modelPath).filename().string()},
             {"n_layer", c.nLayer},
             {"n_head", c.nHead},
             {"n_embd", c.nEmbd},
             {"block_size", c.blockSize},
             {"vocab_size", c.vocabSize},
             {"params", core_->base.model->numParams()}}},
           {"backend", core_->engine.ops->name()},
           {"device",
            std::string(core_->engine.ops->name()) == "cuda" ? caps.gpu : "cpu: " + caps.cpuModel},
           {"version", PTLLM_VERSION},
           {"speculative_lanes", speculativeLanes_},
           {"limits",
            {{"max_tokens", limits_.maxTokens},
             {"max_prompt_chars", limits_.maxPromptChars},
             {"max_train_text_bytes", limits_.maxTrainTextBytes},
             {"max_train_steps", limits_.maxTrainSteps},
             {"max_batch_size", limits_.maxBatch},
             {"max_queue", limits_.maxQueue}}}};
  worker_ = std::thread([this] { run(); });
}

Playground::~Playground() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
  training_.reset();
  core_.reset();  // joins the gate thread, which may still log through our sink
  setGateLogSink(previousSink_);
  hub_.closeAll();
  if (!workDir_.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(workDir_, ec);
  }
}

double Playground::now() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
}

void Playground::onGateLine(const std::string& line) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    gateLines_.push_back(line);
  }
  hub_.publish("gate", {{"line", line}});
}

// ---- snapshots ----

nlohmann::json Playground::info() const {
  return info_;  // immutable after construction
}

nlohmann::json Playground::caps() {
  nlohmann::json j;
  {
    std::lock_guard<std::mutex> lock(mu_);
    j = caps_;
  }
  // Before the worker cached it: build it here (waits for the matmul gates, tens of ms).
  if (j.is_null()) j = capsReport(*core_->engine.ops, *core_->engine.paths);
  std::lock_guard<std::mutex> lock(mu_);
  if (ready_) {  // what inference really runs on, after the model-level gates and the sentinel
    j["pills"] = pills_;
    j["forward_path"] = forwardPath_;
  }
  j["model_gates"] = modelGates_;
  return j;
}

nlohmann::json Playground::statusLocked() const {
  return {{"ready", ready_},        {"warmup_s", warmupSeconds_}, {"forward_path", forwardPath_},
          {"pills", pills_},        {"line", statusLine_},        {"error", warmupError_},
          {"queue", queue_.size()}, {"training", trainRunning_}};
}

nlohmann::json Playground::status() const {
  std::lock_guard<std::mutex> lock(mu_);
  return statusLocked();
}

nlohmann::json Playground::gates() const {
  std::lock_guard<std::mutex> lock(mu_);
  return {{"lines", gateLines_}};
}

nlohmann::json Playground::trainStatusLocked() const {
  nlohmann::json j = {{"state", trainState_}, {"step", 0},
                      {"steps", trainSteps_}, {"train_loss", nullptr},
                      {"val_loss", nullptr},  {"tok_s", 0},
                      {"eta_s", 0},           {"losses", losses_},
                      {"error", trainError_}, {"checkpoint", hasCheckpoint_},
                      {"path", trainPath_}};
  if (!lastStep_.is_null()) j.update(lastStep_);
  return j;
}

nlohmann::json Playground::trainStatus() const {
  std::lock_guard<std::mutex> lock(mu_);
  return trainStatusLocked();
}

Event Playground::hello() {
  nlohmann::json j;
  j["caps"] = caps();
  std::lock_guard<std::mutex> lock(mu_);
  j["status"] = statusLocked();
  j["gates"] = gateLines_;
  j["train"] = trainStatusLocked();
  return Event{"hello", j.dump()};
}

void Playground::publishStatus() {
  nlohmann::json s;
  {
    std::lock_guard<std::mutex> lock(mu_);
    s = statusLocked();
  }
  hub_.publish("status", s);
  hub_.publish("caps", caps());
}

bool Playground::waitReady(double timeoutSeconds) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::duration<double>(timeoutSeconds), [&] { return ready_; });
}

// ---- requests (HTTP threads) ----

std::shared_ptr<GenerationJob> Playground::generate(const nlohmann::json& body) {
  Fields f(body);
  auto job = std::make_shared<GenerationJob>();
  job->prompt = f.get<std::string>("prompt", "");
  SampleOptions& o = job->options;
  o.tokens = f.number<int>("tokens", 200, 1, limits_.maxTokens);
  o.temperature = f.number<float>("temperature", 0.8f, 0.0f, 5.0f);
  o.topK = f.number<int>("top_k", 0, 0, 1 << 20);
  o.topP = f.number<float>("top_p", 1.0f, 1e-6f, 1.0f);
  o.seed = f.get<uint64_t>("seed", 1337);
  const std::string path = f.get<std::string>("path", "auto");
  const std::string model = f.get<std::string>("model", "base");
  job->stream = f.get<bool>("stream", false);
  job->speculativeLanes = f.number<int>("speculative", speculativeLanes_, 0, kMostSpeculativeLanes);
  f.rejectUnknown();
  if (!speculativeLanesOk(job->speculativeLanes))
    throw ApiError(400,
                   "speculative: " + notSpeculativeLanes(std::to_string(job->speculativeLanes)));
  if (path != "auto" && path != "f32")
    throw ApiError(400, fmt::format("path: \"{}\" is not auto or f32", path));
  if (model != "base" && model != "finetuned")
    throw ApiError(400, fmt::format("model: \"{}\" is not base or finetuned", model));
  job->forceF32 = path == "f32";
  job->finetuned = model == "finetuned";
  if (job->prompt.empty()) throw ApiError(400, "prompt: required, and must not be empty");
  if (job->prompt.size() > 4 * limits_.maxPromptChars)
    throw ApiError(400, fmt::format("prompt: longer than {} characters", limits_.maxPromptChars));
  try {
    job->promptTokens = core_->base.tokenizer->encode(job->prompt, "prompt");  // immutable
  } catch (const Error& e) {
    throw ApiError(400, e.what());
  }
  if (job->promptTokens.size() > limits_.maxPromptChars)
    throw ApiError(400, fmt::format("prompt: {} characters, more than {}", job->promptTokens.size(),
                                    limits_.maxPromptChars));
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw ApiError(503, "the server is shutting down");
    if (job->finetuned && !hasCheckpoint_)
      throw ApiError(409, trainRunning_ ? "model: the fine-tune is still running"
                                        : "model: no fine-tune has finished yet");
    if (queue_.size() >= limits_.maxQueue)
      throw ApiError(503,
                     fmt::format("busy: {} requests are queued; try again shortly", queue_.size()));
    job->submittedAt = now();
    queue_.push_back(job);
  }
  cv_.notify_all();
  return job;
}

nlohmann::json Playground::startTraining(const nlohmann::json& body) {
  Fields f(body);
  auto req = std::make_shared<TrainRequest>();
  TrainOptions& o = req->options;
  o.text = f.get<std::string>("text", "");
  o.steps = f.number<int>("steps", 100, 1, limits_.maxTrainSteps);
  o.lr = f.number<float>("lr", 3e-4f, 1e-7f, 1.0f);
  o.batchSize = f.number<int>("batch_size", 8, 1, limits_.maxBatch);
  o.seed = f.get<uint64_t>("seed", 1337);
  f.rejectUnknown();
  if (o.text.empty()) throw ApiError(400, "text: required, and must not be empty");
  if (o.text.size() > limits_.maxTrainTextBytes)
    throw ApiError(
        413, fmt::format("text: {} bytes, more than {}", o.text.size(), limits_.maxTrainTextBytes));
  o.dataPath = "fine-tune text";  // names the text in error messages
  o.initPath = modelPath_;        // the served checkpoint, never a client-supplied path
  o.outPath = workDir_ + "/finetuned.safetensors";
  o.warmup = std::min(10, o.steps / 5);
  o.evalEvery = std::max(1, o.steps / 10);
  o.evalBatches = 2;
  std::future<TrainRequest::Answer> done = req->result.get_future();
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) throw ApiError(503, "the server is shutting down");
    if (trainRunning_ || !trainRequests_.empty())
      throw ApiError(409, "a fine-tune is already running; stop it first");
    trainRequests_.push_back(req);
  }
  cv_.notify_all();
  if (done.wait_for(kTrainStartTimeout) != std::future_status::ready)
    throw ApiError(503, "the engine did not take the fine-tune in time; try again");
  const TrainRequest::Answer answer = done.get();
  if (answer.status != 0) throw ApiError(answer.status, answer.error);
  return trainStatus();
}

nlohmann::json Playground::stopTraining() {
  std::lock_guard<std::mutex> lock(mu_);
  if (trainRunning_) stopRequested_ = true;
  return trainStatusLocked();
}

std::string Playground::checkpointBytes() const {
  std::string path;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!hasCheckpoint_) throw ApiError(404, "no fine-tuned checkpoint yet: run a fine-tune");
    path = checkpointPath_;
  }
  const std::vector<uint8_t> bytes = readBinaryFile(path);  // replaced atomically, never torn
  return std::string(bytes.begin(), bytes.end());
}

// ---- the worker ----

void Playground::run() {
  warmUp();
  bool lastWasGeneration = false;
  for (;;) {
    std::shared_ptr<GenerationJob> job;
    std::shared_ptr<TrainRequest> treq;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        return stop_ || !queue_.empty() || !trainRequests_.empty() || trainRunning_;
      });
      if (stop_) break;
      // Alternate between a queued request and a training step so neither starves.
      const bool step = trainRunning_ && (queue_.empty() || lastWasGeneration);
      if (!trainRequests_.empty()) {
        treq = trainRequests_.front();
        trainRequests_.pop_front();
      } else if (!step) {
        job = queue_.front();
        queue_.pop_front();
      }
    }
    if (treq) {
      startTrainingOnWorker(*treq);
    } else if (job) {
      runGeneration(*job);
      lastWasGeneration = true;
      continue;
    } else {
      trainOneStep();
    }
    lastWasGeneration = false;
  }
  // Shutting down: nothing queued is left waiting.
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& j : queue_) {
    j->events.push("error", {{"error", "the server is shutting down"}});
    j->events.close();
  }
  queue_.clear();
  for (auto& r : trainRequests_) r->refuse(503, "the server is shutting down");
  trainRequests_.clear();
}

void Playground::warmUp() {
  Gpt2& model = *core_->base.model;
  std::string error;
  try {
    model.setPaths(core_->engine.paths.get());
    ModelGate modelGate(model, &*core_->base.tokenizer);  // end-to-end + loss, in the background
    model.prepareForInference();  // waits for the matmul gate, packs for the active path
    core_->baseGates = modelGate.apply();
    model.prepareForInference();
  } catch (const std::exception& e) {
    error = e.what();
    model.setPathUse(false, false);  // a warm-up that broke serves the canonical path only
  }
  const double warm = now();
  const PathEntry* path = model.fastPath(false);
  nlohmann::json caps = capsReport(*core_->engine.ops, *core_->engine.paths);
  const ModelGateReport& mg = core_->baseGates;
  // The pill cluster shows what inference runs on: a path the model-level gates demoted loses
  // its pill like one that failed its matmul gate.
  std::vector<std::string> pills;
  for (const PathEntry& e : core_->engine.paths->entries())
    if (core_->engine.paths->isActive(e.name) && (e.name != mg.path || mg.inferenceOk()))
      pills.push_back(e.pill);
  {
    std::lock_guard<std::mutex> lock(mu_);
    caps_ = std::move(caps);
    modelGates_ = {{"path", mg.path},
                   {"inference_ok", mg.inferenceOk()},
                   {"training_ok", mg.trainingOk()},
                   {"lines", mg.lines()}};
    pills_ = pills;
    forwardPath_ = pathName(path);
    warmupSeconds_ = warm;
    warmupError_ = error;
    statusLine_ = error.empty() ? statusLine(warm, path) : "warm-up failed: " + error;
    ready_ = true;
  }
  cv_.notify_all();
  std::fprintf(stderr, "%s\n", statusLine_.c_str());
  publishStatus();
}

void Playground::runGeneration(GenerationJob& job) {
  const double t0 = now();
  Gpt2* model = core_->base.model.get();
  if (job.finetuned) {
    if (!training_ || !training_->finished) {
      job.events.push("error", {{"error", "model: the fine-tuned model is being retrained"}});
      job.events.close();
      return;
    }
    model = &training_->trainer->model();
  }
  const PathEntry* before = core_->base.model->fastPath(false);
  model->setForceF32(job.forceF32);
  model->setSpeculativeLanes(job.speculativeLanes);
  try {
    model->prepareForInference();  // packs again after a training step invalidated the copies
    const std::string path = pathName(model->fastPath(false));
    const std::string modelName = job.finetuned ? "finetuned" : "base";
    const double queuedMs = 1e3 * (t0 - job.submittedAt);
    job.events.push("start", {{"path", path}, {"model", modelName}, {"queued_ms", queuedMs}});
    const CharTokenizer& tok = *core_->base.tokenizer;
    std::string text;
    Generator gen(*model);
    const auto tokens = gen.generate(job.promptTokens, job.options, [&](int32_t t) {
      if (job.cancelled.load()) throw Cancelled{};
      const std::string piece = tok.decode(t);
      text += piece;
      job.events.push("token", {{"text", piece}});
    });
    const double ms = 1e3 * (now() - t0);
    job.events.push("done", {{"text", text},
                             {"tokens", tokens.size()},
                             {"path", path},
                             {"model", modelName},
                             {"ms", ms},
                             {"tok_s", ms > 0 ? 1e3 * double(tokens.size()) / ms : 0.0},
                             {"queued_ms", queuedMs},
                             {"sentinel_demoted", gen.sentinel().demoted},
                             {"speculative",
                              {{"lanes", job.speculativeLanes},
                               {"lanes_run", gen.speculativeLanes()},
                               {"tokens", gen.speculativeTokens()},
                               {"steps", gen.speculativeSteps()}}}});
  } catch (const Cancelled&) {
  } catch (const std::exception& e) {
    job.events.push("error", {{"error", e.what()}});
  }
  model->setForceF32(false);
  job.events.close();
  // The drift sentinel may have demoted the path: the status bar and the pills say so.
  const PathEntry* after = core_->base.model->fastPath(false);
  if (after != before) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      forwardPath_ = pathName(after);
      if (before) std::erase(pills_, before->pill);
      statusLine_ = statusLine(warmupSeconds_, after);
    }
    publishStatus();
  }
}

void Playground::startTrainingOnWorker(TrainRequest& req) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (trainRunning_) {
      req.refuse(409, "a fine-tune is already running; stop it first");
      return;
    }
  }
  auto t = std::make_unique<Training>();
  try {
    t->trainer = std::make_unique<Trainer>(*core_->engine.ops, req.options);
  } catch (const Error& e) {  // text the tokenizer cannot encode, too short, ...
    req.refuse(400, e.what());
    return;
  } catch (const std::exception& e) {
    req.refuse(500, e.what());
    return;
  }
  Gpt2& m = t->trainer->model();
  m.setPaths(core_->engine.paths.get());
  // The served model's gates ran on the same starting weights: the loss gate's verdict holds.
  const ModelGateReport& mg = core_->baseGates;
  if (!mg.path.empty()) m.setPathUse(mg.trainingOk(), mg.inferenceOk());
  training_ = std::move(t);  // the previous fine-tune's model is gone from here on
  {
    std::lock_guard<std::mutex> lock(mu_);
    trainRunning_ = true;
    stopRequested_ = false;
    hasCheckpoint_ = false;
    trainState_ = "running";
    trainError_.clear();
    trainSteps_ = req.options.steps;
    losses_ = nlohmann::json::array();
    lastStep_ = nullptr;
    trainPath_ = pathName(m.fastPath(true));
  }
  req.result.set_value({});
  hub_.publish("train", trainStatus());
  hub_.publish("status", status());
}

void Playground::trainOneStep() {
  bool stopNow;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopNow = stopRequested_;
  }
  if (stopNow) return finishTraining("stopped", "");
  StepReport r;
  try {
    r = training_->trainer->step();
  } catch (const std::exception& e) {
    return finishTraining("failed", e.what());
  }
  nlohmann::json point = {{"step", r.step},
                          {"train_loss", r.trainLoss},
                          {"val_loss", r.valLoss >= 0 ? nlohmann::json(r.valLoss) : nullptr}};
  nlohmann::json status;
  {
    std::lock_guard<std::mutex> lock(mu_);
    losses_.push_back(point);
    lastStep_ = point;
    lastStep_["tok_s"] = r.tokPerSec;
    lastStep_["eta_s"] = r.etaSec;
    lastStep_["lr"] = r.lr;
    // The val loss of the last evaluation stays on the status between evaluations.
    for (auto it = losses_.rbegin(); it != losses_.rend(); ++it)
      if (!(*it)["val_loss"].is_null()) {
        lastStep_["val_loss"] = (*it)["val_loss"];
        break;
      }
    trainPath_ = pathName(training_->trainer->model().fastPath(true));
    status = trainStatusLocked();
  }
  hub_.publish("train", status);
  if (r.step >= r.totalSteps) finishTraining("done", "");
}

void Playground::finishTraining(const std::string& state, const std::string& error) {
  std::string finalState = state, finalError = error;
  if (state != "failed") {
    try {
      Trainer& tr = *training_->trainer;
      tr.save(tr.options().outPath);  // atomic; the optimizer state beside it
      gateLog("[serve] model-level gates on the fine-tuned weights:");
      ModelGate(tr.model(), &tr.tokenizer()).apply();
      tr.model().prepareForInference();
      training_->finished = true;
    } catch (const std::exception& e) {
      finalState = "failed";
      finalError = e.what();
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    trainRunning_ = false;
    stopRequested_ = false;
    trainState_ = finalState;
    trainError_ = finalError;
    hasCheckpoint_ = finalState != "failed";
    if (hasCheckpoint_) checkpointPath_ = training_->trainer->options().outPath;
  }
  hub_.publish("train", trainStatus());
  hub_.publish("status", status());
}

}  // namespace ptllm::app
