#include "io/safetensors.hpp"

#include <algorithm>
#include <cstring>

#include <nlohmann/json.hpp>

namespace mha::io {
namespace {

[[noreturn]] void fail(const std::string &name, const std::string &what) { throw FileError(name + ": " + what); }

// safetensors dtype -> (numpy dtype, element size); empty if unsupported.
std::pair<std::string, int64_t> numpy_dtype(const std::string &d) {
    if (d == "F32") return {"<f4", 4};
    if (d == "F64") return {"<f8", 8};
    if (d == "I32") return {"<i4", 4};
    if (d == "I64") return {"<i8", 8};
    if (d == "U8") return {"|u1", 1};
    if (d == "BOOL") return {"|b1", 1};
    return {"", 0};
}

} // namespace

SafeTensors SafeTensors::parse(const std::string &name, std::vector<uint8_t> file) {
    SafeTensors st;
    st.name_ = name;
    if (file.size() < 8) fail(name, "expected a safetensors file (8-byte header length), found " + std::to_string(file.size()) + " bytes");
    uint64_t header_len = 0;
    for (int i = 7; i >= 0; --i) header_len = header_len << 8 | file[static_cast<size_t>(i)];
    if (header_len > file.size() - 8)
        fail(name, "the safetensors header claims " + std::to_string(header_len) + " bytes but the file has only " +
                       std::to_string(file.size() - 8) + " after the length (truncated, or not safetensors)");
    nlohmann::json header;
    try {
        header = nlohmann::json::parse(file.begin() + 8, file.begin() + 8 + static_cast<std::ptrdiff_t>(header_len));
    } catch (const nlohmann::json::exception &e) {
        fail(name, std::string("the safetensors header is not valid JSON (") + e.what() + ")");
    }
    if (!header.is_object()) fail(name, "the safetensors header is not a JSON object");
    const size_t data_at = 8 + header_len, data_size = file.size() - data_at;
    std::vector<std::pair<size_t, size_t>> ranges;
    for (const auto &[key, t] : header.items()) {
        if (key == "__metadata__") continue;
        const std::string where = "tensor \"" + key + "\"";
        if (!t.is_object() || !t.contains("dtype") || !t.contains("shape") || !t.contains("data_offsets"))
            fail(name, where + ": expected an object with dtype, shape and data_offsets");
        if (!t["dtype"].is_string()) fail(name, where + ": dtype is not a string");
        Entry e;
        e.dtype = t["dtype"].get<std::string>();
        const auto [np, esize] = numpy_dtype(e.dtype);
        if (!esize) fail(name, where + ": unsupported dtype " + e.dtype + " (expected F32, F64, I32, I64, U8 or BOOL)");
        if (!t["shape"].is_array()) fail(name, where + ": shape is not an array");
        int64_t count = 1;
        for (const auto &d : t["shape"]) {
            if (!d.is_number_unsigned()) fail(name, where + ": shape holds " + d.dump() + ", not a size");
            const uint64_t v = d.get<uint64_t>();
            if (v > static_cast<uint64_t>(INT64_MAX) || __builtin_mul_overflow(count, static_cast<int64_t>(v), &count))
                fail(name, where + ": the shape overflows");
            e.shape.push_back(static_cast<int64_t>(v));
        }
        const auto &off = t["data_offsets"];
        if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() || !off[1].is_number_unsigned())
            fail(name, where + ": data_offsets must be [begin, end]");
        const uint64_t b = off[0].get<uint64_t>(), en = off[1].get<uint64_t>();
        if (b > en || en > data_size)
            fail(name, where + ": data_offsets [" + std::to_string(b) + ", " + std::to_string(en) +
                           "] lie outside the " + std::to_string(data_size) + " bytes of data");
        int64_t bytes;
        if (__builtin_mul_overflow(count, esize, &bytes) || static_cast<uint64_t>(bytes) != en - b)
            fail(name, where + ": shape " + shape_str(e.shape) + " of " + e.dtype + " needs " +
                           std::to_string(count) + " x " + std::to_string(esize) + " bytes, but data_offsets give " +
                           std::to_string(en - b));
        e.begin = data_at + b;
        e.end = data_at + en;
        ranges.emplace_back(b, en);
        st.tensors_[key] = std::move(e);
    }
    std::sort(ranges.begin(), ranges.end());
    for (size_t i = 1; i < ranges.size(); ++i)
        if (ranges[i].first < ranges[i - 1].second) fail(name, "the data_offsets of two tensors overlap");
    st.file_ = std::move(file);
    return st;
}

SafeTensors SafeTensors::read(const std::string &path) { return parse(path, read_file(path)); }

std::vector<std::string> SafeTensors::keys() const {
    std::vector<std::string> k;
    for (const auto &[key, e] : tensors_) k.push_back(key);
    return k;
}

Array SafeTensors::get(const std::string &key) const {
    const auto it = tensors_.find(key);
    if (it == tensors_.end()) fail(name_, "no tensor \"" + key + "\"");
    Array a;
    a.dtype = numpy_dtype(it->second.dtype).first;
    a.shape = it->second.shape;
    a.bytes.assign(file_.begin() + static_cast<std::ptrdiff_t>(it->second.begin),
                   file_.begin() + static_cast<std::ptrdiff_t>(it->second.end));
    return a;
}

} // namespace mha::io
