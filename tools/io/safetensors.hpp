// A small reader for the safetensors format: an 8-byte little-endian header length, a JSON header
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the data, with offsets relative to its start. Every offset and size is checked against the
// file before any tensor is read; failures throw FileError naming the file, what was expected and
// what was found.
#pragma once

#include <map>
#include <span>
#include <string>
#include <vector>

#include "io/npy.hpp"

namespace mha::io {

class SafeTensors {
public:
    // Parses and checks the whole file.
    static SafeTensors parse(const std::string &name, std::vector<uint8_t> file);
    static SafeTensors read(const std::string &path);

    bool contains(const std::string &key) const { return tensors_.count(key) != 0; }
    std::vector<std::string> keys() const;
    // The tensor as an Array (dtype mapped to numpy's: F32 -> "<f4", BOOL -> "|b1", ...). Throws
    // FileError if the key is missing.
    Array get(const std::string &key) const;

private:
    struct Entry {
        std::string dtype;
        std::vector<int64_t> shape;
        size_t begin = 0, end = 0;  // absolute offsets in file_
    };
    std::string name_;
    std::vector<uint8_t> file_;
    std::map<std::string, Entry> tensors_;
};

} // namespace mha::io
