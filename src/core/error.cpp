#include "core/error.h"

#include <cstdio>
#include <cstdlib>

namespace ptllm {

void assertionFailed(const char* expr, const char* file, int line, const std::string& msg) {
  std::fprintf(stderr, "internal error: %s:%d: assertion `%s` failed%s%s\n", file, line, expr,
               msg.empty() ? "" : ": ", msg.c_str());
  std::abort();
}

}  // namespace ptllm
