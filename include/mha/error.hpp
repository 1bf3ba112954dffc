// Errors of the C++ API: every public entry point validates its arguments once and throws
// mha::Error with the status the C ABI returns and a message naming the argument.
#pragma once

#include <stdexcept>
#include <string>

namespace mha {

enum class Status : int { ok = 0, invalid_argument = 1, out_of_memory = 2, unsupported = 3, internal = 4 };

class Error : public std::runtime_error {
public:
    Error(Status status, const std::string &message) : std::runtime_error(message), status_(status) {}
    Status status() const noexcept { return status_; }

private:
    Status status_;
};

[[noreturn]] inline void invalid_argument(const std::string &message) {
    throw Error(Status::invalid_argument, message);
}

} // namespace mha
