// Errors: bad input at a boundary throws ptllm::Error with a one-line message naming the
// file/field/value; a broken internal invariant fails PTLLM_ASSERT with file:line.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace ptllm {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Throws ptllm::Error with a fmt-formatted message.
template <typename... Args>
[[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

[[noreturn]] void assertionFailed(const char* expr, const char* file, int line,
                                  const std::string& msg);

}  // namespace ptllm

#define PTLLM_ASSERT(cond, ...)                                                                    \
  do {                                                                                             \
    if (!(cond)) ::ptllm::assertionFailed(#cond, __FILE__, __LINE__, fmt::format("" __VA_ARGS__)); \
  } while (0)
