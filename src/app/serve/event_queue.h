// Events from the engine worker to HTTP clients. An EventQueue has one consumer (an SSE stream
// or a generation request); an EventHub fans published events out to every subscriber. The
// worker only ever pushes: it never waits on a client. A bounded queue drops its oldest event
// when a slow client falls behind; an unbounded one (a generation's tokens) keeps all.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace ptllm::app {

struct Event {
  std::string name;  // SSE event name: "gate", "status", "token", ...
  std::string data;  // compact JSON (no newlines)
  std::string sse() const { return "event: " + name + "\ndata: " + data + "\n\n"; }
};

class EventQueue {
 public:
  explicit EventQueue(size_t capacity = 0) : capacity_(capacity) {}  // 0: unbounded
  void push(Event e);
  void push(const std::string& name, const nlohmann::json& data) { push(Event{name, data.dump()}); }
  // The next event, waiting up to `timeout`; nullopt on timeout, or once closed and drained.
  std::optional<Event> pop(std::chrono::milliseconds timeout);
  void close();  // wakes the consumer; later pushes are dropped
  bool closed() const;
  size_t dropped() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Event> events_;
  size_t capacity_;
  size_t dropped_ = 0;
  bool closed_ = false;
};

class EventHub {
 public:
  EventHub(size_t maxSubscribers, size_t queueCapacity)
      : maxSubscribers_(maxSubscribers), queueCapacity_(queueCapacity) {}
  // A new subscriber's queue, with `first` already in it; nullptr when at capacity.
  std::shared_ptr<EventQueue> subscribe(const Event& first);
  void unsubscribe(const std::shared_ptr<EventQueue>& q);
  void publish(const std::string& name, const nlohmann::json& data);
  void closeAll();  // every subscriber's stream ends (server shutdown)
  size_t subscribers() const;

 private:
  mutable std::mutex mu_;
  std::vector<std::shared_ptr<EventQueue>> subs_;
  size_t maxSubscribers_, queueCapacity_;
  bool closed_ = false;
};

}  // namespace ptllm::app
