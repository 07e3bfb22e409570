#include "app/serve/http_api.h"

#include <fmt/format.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "app/serve/web_assets.h"
#include "core/error.h"

namespace ptllm::app {

namespace {

using namespace std::chrono_literals;
// An idle stream writes an SSE comment this often: it keeps proxies awake and, since a write is
// how a server learns its peer left, frees a departed subscriber's slot within seconds.
constexpr auto kKeepAlive = 2s;
// Each connection holds a thread while the server reads its request, however slowly the client
// sends it (cpp-httplib's read timeout is per read, not per request). So connections get
// threads on demand, up to a cap far above what a page and its tabs open: a few dozen stalled
// sockets (a slow-loris client) no longer take every thread, and a request that stalls for
// kReadTimeout between reads is dropped.
constexpr size_t kMaxConnectionThreads = 256;
constexpr auto kReadTimeout = 5s;

// cpp-httplib's task queue with threads started as connections need them (its own ThreadPool
// starts a fixed count up front): idle threads take queued connections first, and a thread
// is added while none is idle, up to `max`.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  explicit ConnectionThreads(size_t max) : max_(max) {}
  ~ConnectionThreads() override { shutdown(); }

  void enqueue(std::function<void()> fn) override {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(fn));
    // Each idle thread will take one queued connection; any beyond them gets a new thread
    // (counted idle from its start, so that a burst does not start one per wake-up race).
    if (jobs_.size() > idle_ && threads_.size() < max_) {
      ++idle_;
      threads_.emplace_back([this] { work(); });
    } else {
      cv_.notify_one();
    }
  }

  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stopping_) return;
      stopping_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

 private:
  void work() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
      --idle_;
      if (jobs_.empty()) return;  // stopping, and every accepted connection was served
      std::function<void()> fn = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      fn();
      lock.lock();
      ++idle_;
    }
  }

  const size_t max_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

const char* kJson = "application/json";

void sendJson(httplib::Response& res, int status, const nlohmann::json& body) {
  res.status = status;
  res.set_content(body.dump(), kJson);
}

void sendError(httplib::Response& res, int status, const std::string& message) {
  sendJson(res, status, {{"error", message}});
}

// A POST's JSON body. Only application/json is accepted: a cross-origin page can send
// text/plain without asking, but not JSON, so this also keeps other sites' pages out.
nlohmann::json parseBody(const httplib::Request& req) {
  const std::string type = req.get_header_value("Content-Type");
  if (type.rfind(kJson, 0) != 0)
    throw ApiError(415, "Content-Type must be application/json (got \"" + type + "\")");
  nlohmann::json body = nlohmann::json::parse(req.body, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) throw ApiError(400, "the request body is not valid JSON");
  return body;
}

std::string statusText(int status) {
  switch (status) {
    case 404:
      return "no such endpoint";
    case 405:
      return "method not allowed";
    case 413:
      return "request body too large";
    case 414:
      return "URI too long";
    default:
      return fmt::format("HTTP {}", status);
  }
}

bool isLoopback(const std::string& host) {
  return host == "127.0.0.1" || host == "localhost" || host == "::1";
}

}  // namespace

struct HttpApi::Impl {
  Playground& pg;
  httplib::Server svr;
  std::set<std::string> allowedHosts;  // Host headers accepted (loopback binds only)
  std::atomic<bool> stopping{false};

  explicit Impl(Playground& p) : pg(p) {}

  // Runs a handler; an ApiError becomes its status and message, anything else a 500.
  template <typename F>
  httplib::Server::Handler guarded(F f) {
    return [f](const httplib::Request& req, httplib::Response& res) {
      try {
        f(req, res);
      } catch (const ApiError& e) {
        sendError(res, e.status(), e.what());
      } catch (const nlohmann::json::exception& e) {
        sendError(res, 400, std::string("the request body: ") + e.what());
      } catch (const std::exception& e) {
        sendError(res, 500, e.what());
      }
    };
  }

  void routes();
  void streamEvents(httplib::Response& res);
  void generate(const httplib::Request& req, httplib::Response& res);
};

void HttpApi::Impl::routes() {
  svr.set_payload_max_length(pg.limits().maxBodyBytes);
  svr.new_task_queue = [] { return new ConnectionThreads(kMaxConnectionThreads); };
  svr.set_read_timeout(kReadTimeout);
  svr.set_write_timeout(30, 0);

  // DNS rebinding: a loopback server answers only to loopback names.
  svr.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
    if (!allowedHosts.empty() && !allowedHosts.count(req.get_header_value("Host"))) {
      sendError(res, 421, "Host \"" + req.get_header_value("Host") + "\" is not this server");
      return httplib::Server::HandlerResponse::Handled;
    }
    res.set_header("X-Content-Type-Options", "nosniff");
    res.set_header("Cache-Control", "no-store");
    return httplib::Server::HandlerResponse::Unhandled;
  });
  svr.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (res.body.empty())
      sendError(res, res.status,
                fmt::format("{} {}: {}", req.method, req.path, statusText(res.status)));
  });
  svr.set_exception_handler(
      [](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
        std::string what = "internal error";
        try {
          if (ep) std::rethrow_exception(ep);
        } catch (const std::exception& e) {
          what = e.what();
        } catch (...) {
        }
        sendError(res, 500, what);
      });

  for (const WebAsset& a : webAssets()) {
    svr.Get(std::string(a.path), [a](const httplib::Request&, httplib::Response& res) {
      res.set_content(a.body.data(), a.body.size(), std::string(a.contentType).c_str());
      // The page talks only to this server; nothing else may be loaded or contacted.
      res.set_header("Content-Security-Policy",
                     "default-src 'self'; img-src 'self' data: blob:; style-src 'self'; "
                     "connect-src 'self'; frame-ancestors 'none'");
    });
  }
  svr.Get("/api/info", guarded([this](const auto&, auto& res) { sendJson(res, 200, pg.info()); }));
  svr.Get("/api/caps", guarded([this](const auto&, auto& res) { sendJson(res, 200, pg.caps()); }));
  svr.Get("/api/status",
          guarded([this](const auto&, auto& res) { sendJson(res, 200, pg.status()); }));
  svr.Get("/api/gates",
          guarded([this](const auto&, auto& res) { sendJson(res, 200, pg.gates()); }));
  svr.Get("/api/train",
          guarded([this](const auto&, auto& res) { sendJson(res, 200, pg.trainStatus()); }));
  svr.Get("/api/events", guarded([this](const auto&, auto& res) { streamEvents(res); }));
  svr.Post("/api/generate", guarded([this](const auto& req, auto& res) { generate(req, res); }));
  svr.Post("/api/train", guarded([this](const auto& req, auto& res) {
             sendJson(res, 202, pg.startTraining(parseBody(req)));
           }));
  svr.Post("/api/train/stop",
           guarded([this](const auto&, auto& res) { sendJson(res, 200, pg.stopTraining()); }));
  svr.Get("/api/checkpoint", guarded([this](const auto&, auto& res) {
            res.set_content(pg.checkpointBytes(), "application/octet-stream");
            res.set_header("Content-Disposition", "attachment; filename=\"finetuned.safetensors\"");
          }));
}

void HttpApi::Impl::streamEvents(httplib::Response& res) {
  std::shared_ptr<EventQueue> sub = pg.events().subscribe(pg.hello());
  if (!sub)
    throw ApiError(503,
                   fmt::format("too many event streams (at most {})", pg.limits().maxSubscribers));
  res.set_chunked_content_provider(
      "text/event-stream",
      [sub](size_t, httplib::DataSink& sink) {
        std::optional<Event> e = sub->pop(kKeepAlive);
        if (!e && sub->closed()) {
          sink.done();
          return true;
        }
        const std::string text = e ? e->sse() : std::string(": keep-alive\n\n");
        return sink.write(text.data(), text.size());
      },
      [this, sub](bool) { pg.events().unsubscribe(sub); });
}

void HttpApi::Impl::generate(const httplib::Request& req, httplib::Response& res) {
  std::shared_ptr<GenerationJob> job = pg.generate(parseBody(req));
  if (job->stream) {
    res.set_chunked_content_provider(
        "text/event-stream",
        [job](size_t, httplib::DataSink& sink) {
          std::optional<Event> e = job->events.pop(kKeepAlive);
          if (!e && job->events.closed()) {
            sink.done();
            return true;
          }
          const std::string text = e ? e->sse() : std::string(": keep-alive\n\n");
          if (!sink.write(text.data(), text.size())) {
            job->cancelled = true;
            return false;
          }
          return true;
        },
        [job](bool success) {
          if (!success) job->cancelled = true;  // the client went away: stop generating
        });
    return;
  }
  // Non-streaming: wait for the job's end (bounded by the token limit).
  for (;;) {
    std::optional<Event> e = job->events.pop(kKeepAlive);
    if (!e) {
      if (job->events.closed()) throw ApiError(503, "the server is shutting down");
      continue;
    }
    if (e->name == "done") {
      res.status = 200;
      res.set_content(e->data, kJson);
      return;
    }
    if (e->name == "error") {
      res.status = 500;
      res.set_content(e->data, kJson);
      return;
    }
  }
}

HttpApi::HttpApi(Playground& playground) : impl_(std::make_unique<Impl>(playground)) {
  impl_->routes();
}

HttpApi::~HttpApi() {
  stop();
}

int HttpApi::bind(const std::string& host, int port) {
  if (port < 0 || port > 65535) fail("--port {}: expected 0..65535", port);
  const int bound = port == 0 ? impl_->svr.bind_to_any_port(host)
                              : (impl_->svr.bind_to_port(host, port) ? port : -1);
  if (bound <= 0)
    fail("serve: cannot listen on {}:{} (in use, or not an address of this machine)", host, port);
  if (isLoopback(host)) {
    for (const std::string name : {"127.0.0.1", "localhost", "[::1]"})
      impl_->allowedHosts.insert(fmt::format("{}:{}", name, bound));
  }
  return bound;
}

bool HttpApi::listen() {
  return impl_->svr.listen_after_bind();
}

void HttpApi::stop() {
  if (impl_->stopping.exchange(true)) return;
  impl_->pg.events().closeAll();  // event streams end, so their threads are free to join
  impl_->svr.stop();
}

}  // namespace ptllm::app
