// Error handling shared by the core: exceptions carry file:line and a readable message.
#pragma once
#include <stdexcept>
#include <string>

namespace metamat {

// Thrown for bad arguments reaching the core (Python validates first; this is the backstop).
struct CoreError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void fail(const char* file, int line, const std::string& msg) {
  throw CoreError(std::string(file) + ":" + std::to_string(line) + ": " + msg);
}

}  // namespace metamat

#define MM_CHECK(cond, msg)                                   \
  do {                                                        \
    if (!(cond)) ::metamat::fail(__FILE__, __LINE__, (msg));  \
  } while (0)
