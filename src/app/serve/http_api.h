// The HTTP face of the playground (docs/playground.md): routes, request checks and the
// server-sent event streams, on cpp-httplib. It holds no model: every request becomes a
// Playground call or job.
#pragma once

#include <memory>
#include <string>

#include "app/serve/playground.h"

namespace ptllm::app {

class HttpApi {
 public:
  explicit HttpApi(Playground& playground);
  ~HttpApi();
  HttpApi(const HttpApi&) = delete;
  HttpApi& operator=(const HttpApi&) = delete;

  // Binds host:port (0: any free port) and returns the port; throws ptllm::Error naming the
  // address when it cannot.
  int bind(const std::string& host, int port);
  // Serves until stop(); returns false if the server failed.
  bool listen();
  // Ends every event stream and stops the server; safe from any thread.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ptllm::app
