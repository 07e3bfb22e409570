// The playground page (web/), compiled into the binary at build time (cmake/embed_web.cmake)
// so `ptllm serve` needs no files beside it and fetches nothing from anywhere.
#pragma once

#include <string_view>
#include <vector>

namespace ptllm::app {

struct WebAsset {
  std::string_view path;         // URL path, e.g. "/app.js" ("/" for index.html)
  std::string_view contentType;  // e.g. "text/javascript; charset=utf-8"
  std::string_view body;
};

const std::vector<WebAsset>& webAssets();

}  // namespace ptllm::app
