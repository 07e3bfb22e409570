#include "gate/telemetry.h"

#include <fcntl.h>
#include <httplib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

#include "core/file_io.h"
#include "gate/gate_cache.h"

namespace ptllm {
namespace {

std::string utcNow() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

// The POST sink: one background thread, a bounded queue, short timeouts.
class Sink {
 public:
  Sink(std::string hostPort, std::string path)
      : hostPort_(std::move(hostPort)), path_(std::move(path)), thread_([this] { loop(); }) {}
  ~Sink() {
    flush(std::chrono::milliseconds(2000));
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
      queue_.clear();
    }
    cv_.notify_all();
    thread_.join();
  }
  void post(std::string body) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (queue_.size() >= kMaxQueue) return;  // dropped: telemetry never grows without bound
      queue_.push_back(std::move(body));
    }
    cv_.notify_all();
  }
  bool flush(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    return idle_.wait_for(lock, timeout, [this] { return queue_.empty() && !busy_; });
  }

 private:
  static constexpr size_t kMaxQueue = 256;
  void loop() {
    httplib::Client cli(hostPort_);
    cli.set_connection_timeout(std::chrono::milliseconds(500));
    cli.set_read_timeout(std::chrono::milliseconds(1000));
    cli.set_write_timeout(std::chrono::milliseconds(1000));
    cli.set_keep_alive(false);
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (stop_) break;
      std::string body = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      std::string error;
      try {
        auto res = cli.Post(path_, body, "application/json");
        if (!res)
          error = httplib::to_string(res.error());
        else if (res->status < 200 || res->status >= 300)
          error = "HTTP " + std::to_string(res->status);
      } catch (const std::exception& ex) {
        error = ex.what();
      }
      if (!error.empty() && !warned_.exchange(true))
        std::fprintf(stderr, "ptllm: telemetry: POST to %s%s failed (%s); the run goes on\n",
                     hostPort_.c_str(), path_.c_str(), error.c_str());
      lock.lock();
      busy_ = false;
      if (queue_.empty()) idle_.notify_all();
    }
    busy_ = false;
    idle_.notify_all();
  }

  std::string hostPort_, path_;
  std::mutex mu_;
  std::condition_variable cv_, idle_;
  std::deque<std::string> queue_;
  bool stop_ = false, busy_ = false;
  std::atomic<bool> warned_{false};
  std::thread thread_;  // last: starts after the members above exist
};

std::mutex& sinkMutex() {
  static std::mutex m;
  return m;
}
std::shared_ptr<Sink>& sinkSlot() {
  static std::shared_ptr<Sink> s;
  return s;
}
std::shared_ptr<Sink> currentSink() {
  std::lock_guard<std::mutex> lock(sinkMutex());
  return sinkSlot();
}

std::mutex& fileMutex() {
  static std::mutex m;
  return m;
}

}  // namespace

std::string telemetryFile() {
  if (const char* x = std::getenv("XDG_STATE_HOME"); x && *x == '/')
    return std::string(x) + "/ptllm/telemetry.jsonl";
  if (const char* h = std::getenv("HOME"); h && *h)
    return std::string(h) + "/.local/state/ptllm/telemetry.jsonl";
  return {};
}

nlohmann::json telemetryRecord(const GateResult& r, const Capabilities& caps,
                               const std::string& backend) {
  nlohmann::json j = toJson(r);
  j["event"] = "gate";
  j["time"] = utcNow();
  j["backend"] = backend;
  j["cpu_model"] = caps.cpuModel;
  j["dispatched_target"] = caps.dispatchedTarget;
  nlohmann::json flags = nlohmann::json::array();
  for (const auto& [name, on] : caps.flags)
    if (on) flags.push_back(name);
  j["flags"] = flags;
  j["build_id"] = binaryBuildIdHex();
  return j;
}

void recordTelemetry(const nlohmann::json& record) {
  std::string line;
  try {
    line = record.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } catch (const std::exception&) {
    return;
  }
  static std::atomic<bool> warned{false};
  const std::string file = telemetryFile();
  bool ok = false;
  if (!file.empty()) {
    std::lock_guard<std::mutex> lock(fileMutex());
    if (makeDirs(file.substr(0, file.rfind('/')))) {
      const int fd = ::open(file.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
      if (fd >= 0) {
        const std::string withNl = line + "\n";
        ok = ::write(fd, withNl.data(), withNl.size()) == ssize_t(withNl.size());
        ::close(fd);
      }
    }
  }
  if (!ok && !warned.exchange(true))
    std::fprintf(stderr, "ptllm: telemetry: cannot append to %s; the run goes on\n",
                 file.empty() ? "(no $XDG_STATE_HOME or $HOME)" : file.c_str());
  if (auto sink = currentSink()) sink->post(line);
}

void setTelemetryUrl(const std::string& url) {
  std::shared_ptr<Sink> next;
  if (!url.empty()) {
    const std::string scheme = "http://";
    if (url.compare(0, scheme.size(), scheme) != 0 || url.size() == scheme.size()) {
      std::fprintf(stderr, "ptllm: telemetry: '%s' is not an http:// URL; no sink\n", url.c_str());
    } else {
      const size_t slash = url.find('/', scheme.size());
      const std::string hostPort = url.substr(0, slash);
      const std::string path = slash == std::string::npos ? "/" : url.substr(slash);
      next = std::make_shared<Sink>(hostPort, path);
    }
  }
  std::shared_ptr<Sink> old;
  {
    std::lock_guard<std::mutex> lock(sinkMutex());
    old = std::move(sinkSlot());
    sinkSlot() = std::move(next);
  }
  // old (if last owner) flushes for at most ~2 s and joins here, outside the lock.
}

bool flushTelemetry(std::chrono::milliseconds timeout) {
  auto sink = currentSink();
  return !sink || sink->flush(timeout);
}

}  // namespace ptllm
