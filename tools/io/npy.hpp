// A small reader and writer for numpy's .npy format (format versions 1.0 to 3.0; little-endian
// float32, float64, int32, int64, uint8 and bool; C order). Every failure throws FileError with a
// message that names the file, what was expected and what was found.
#pragma once

#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace mha::io {

class FileError : public std::runtime_error {
public:
    using std::runtime_error::runtime_error;
};

// An array as stored: its numpy dtype string ("<f4", "|b1", ...), shape and raw little-endian bytes.
struct Array {
    std::string dtype;
    std::vector<int64_t> shape;
    std::vector<uint8_t> bytes;
    int64_t count() const;
    std::string shape_str() const;  // "[2, 3]"
};

// The whole file; `name` is used in messages.
std::vector<uint8_t> read_file(const std::string &path);
Array parse_npy(const std::string &name, std::span<const uint8_t> file);
Array read_npy(const std::string &path);

// The values as float32 (the dtype must be <f4), checking the rank and every dimension that is not
// -1 in `shape`.
std::vector<float> to_floats(const std::string &name, const Array &a, const std::vector<int64_t> &shape);
// The values as bytes, 0 or 1 (the dtype must be |b1 or |u1), checked as in to_floats.
std::vector<uint8_t> to_bools(const std::string &name, const Array &a, const std::vector<int64_t> &shape);

// Writes a float32 .npy (version 1.0). Writes to a temporary file and renames it, so a failure
// never leaves a partial file at path.
void write_npy(const std::string &path, const std::vector<int64_t> &shape, const float *data);

std::string shape_str(const std::vector<int64_t> &shape);  // "[2, 3]"; -1 (any size) prints as "*"

} // namespace mha::io
