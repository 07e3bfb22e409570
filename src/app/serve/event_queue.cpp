#include "app/serve/event_queue.h"

#include <algorithm>

namespace ptllm::app {

void EventQueue::push(Event e) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    if (capacity_ > 0 && events_.size() >= capacity_) {
      events_.pop_front();
      ++dropped_;
    }
    events_.push_back(std::move(e));
  }
  cv_.notify_one();
}

std::optional<Event> EventQueue::pop(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return closed_ || !events_.empty(); });
  if (events_.empty()) return std::nullopt;
  Event e = std::move(events_.front());
  events_.pop_front();
  return e;
}

void EventQueue::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
  }
  cv_.notify_all();
}

bool EventQueue::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

size_t EventQueue::dropped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return dropped_;
}

std::shared_ptr<EventQueue> EventHub::subscribe(const Event& first) {
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_ || subs_.size() >= maxSubscribers_) return nullptr;
  auto q = std::make_shared<EventQueue>(queueCapacity_);
  q->push(first);
  subs_.push_back(q);
  return q;
}

void EventHub::unsubscribe(const std::shared_ptr<EventQueue>& q) {
  std::lock_guard<std::mutex> lock(mu_);
  subs_.erase(std::remove(subs_.begin(), subs_.end(), q), subs_.end());
  q->close();
}

void EventHub::publish(const std::string& name, const nlohmann::json& data) {
  const Event e{name, data.dump()};
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& q : subs_) q->push(e);
}

void EventHub::closeAll() {
  std::lock_guard<std::mutex> lock(mu_);
  closed_ = true;
  for (const auto& q : subs_) q->close();
  subs_.clear();
}

size_t EventHub::subscribers() const {
  std::lock_guard<std::mutex> lock(mu_);
  return subs_.size();
}

}  // namespace ptllm::app
