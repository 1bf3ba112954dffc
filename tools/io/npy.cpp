#include "io/npy.hpp"

#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>

namespace mha::io {
namespace {

[[noreturn]] void fail(const std::string &name, const std::string &what) { throw FileError(name + ": " + what); }

int64_t dtype_size(const std::string &d) {
    if (d == "<f4" || d == "<i4" || d == "<u4") return 4;
    if (d == "<f8" || d == "<i8" || d == "<u8") return 8;
    if (d == "|b1" || d == "|u1" || d == "|i1") return 1;
    return 0;
}

// The value of 'key' in numpy's header dict, as written by numpy: {'descr': '<f4', 'fortran_order':
// False, 'shape': (2, 3), }. Returns the text after "'key':", trimmed of spaces.
std::string field(const std::string &name, const std::string &header, const std::string &key) {
    const std::string k = "'" + key + "'";
    const size_t at = header.find(k);
    if (at == std::string::npos) fail(name, "the .npy header has no " + k + " (found: " + header + ")");
    size_t p = header.find(':', at + k.size());
    if (p == std::string::npos) fail(name, "the .npy header is malformed near " + k);
    ++p;
    while (p < header.size() && header[p] == ' ') ++p;
    return header.substr(p);
}

std::vector<int64_t> parse_shape(const std::string &name, const std::string &text) {
    if (text.empty() || text[0] != '(') fail(name, "the .npy shape is not a tuple: " + text.substr(0, 40));
    const size_t close = text.find(')');
    if (close == std::string::npos) fail(name, "the .npy shape has no closing ')'");
    std::vector<int64_t> shape;
    size_t p = 1;
    while (p < close) {
        while (p < close && (text[p] == ' ' || text[p] == ',')) ++p;
        if (p >= close) break;
        int64_t v = 0;
        size_t digits = 0;
        while (p < close && text[p] >= '0' && text[p] <= '9') {
            if (__builtin_mul_overflow(v, 10, &v) || __builtin_add_overflow(v, text[p] - '0', &v))
                fail(name, "a dimension of the .npy shape overflows");
            ++p;
            ++digits;
        }
        if (digits == 0) fail(name, "the .npy shape " + text.substr(0, close + 1) + " is not a tuple of integers");
        shape.push_back(v);
    }
    return shape;
}

} // namespace

std::string shape_str(const std::vector<int64_t> &shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
    return s + "]";
}

int64_t Array::count() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
}

std::string Array::shape_str() const { return io::shape_str(shape); }

std::vector<uint8_t> read_file(const std::string &path) {
    std::ifstream f(path, std::ios::binary);
    if (!f) fail(path, "cannot open the file (missing or unreadable)");
    std::vector<uint8_t> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
    if (f.bad()) fail(path, "read error");
    return data;
}

Array parse_npy(const std::string &name, std::span<const uint8_t> file) {
    static const uint8_t magic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
    if (file.size() < 10 || std::memcmp(file.data(), magic, 6) != 0)
        fail(name, "expected a .npy file (magic \\x93NUMPY), found " +
                       (file.size() < 6 ? std::to_string(file.size()) + " bytes" : std::string("other data")));
    const int major = file[6];
    size_t header_len, start;
    if (major == 1) {
        header_len = file[8] | (size_t{file[9]} << 8);
        start = 10;
    } else if (major == 2 || major == 3) {
        if (file.size() < 12) fail(name, "the .npy header is truncated");
        header_len = file[8] | (size_t{file[9]} << 8) | (size_t{file[10]} << 16) | (size_t{file[11]} << 24);
        start = 12;
    } else {
        fail(name, "expected .npy format version 1, 2 or 3, found " + std::to_string(major));
    }
    if (header_len > file.size() - start)
        fail(name, "the .npy header claims " + std::to_string(header_len) + " bytes but the file has " +
                       std::to_string(file.size() - start) + " after the preamble (truncated?)");
    const std::string header(reinterpret_cast<const char *>(file.data() + start), header_len);
    Array a;
    const std::string descr = field(name, header, "descr");
    if (descr.size() < 2 || descr[0] != '\'') fail(name, "the .npy 'descr' is not a string");
    a.dtype = descr.substr(1, descr.find('\'', 1) == std::string::npos ? 0 : descr.find('\'', 1) - 1);
    if (a.dtype == "<b1" || a.dtype == "=b1") a.dtype = "|b1";
    if (a.dtype == "<u1" || a.dtype == "=u1") a.dtype = "|u1";
    const int64_t esize = dtype_size(a.dtype);
    if (!esize) fail(name, "unsupported dtype '" + a.dtype + "' (expected float32 '<f4', bool, uint8, int32 or int64)");
    if (field(name, header, "fortran_order").rfind("False", 0) != 0)
        fail(name, "expected a C-order array, found fortran_order True");
    a.shape = parse_shape(name, field(name, header, "shape"));
    int64_t count = 1;
    for (int64_t d : a.shape)
        if (__builtin_mul_overflow(count, d, &count)) fail(name, "the shape " + a.shape_str() + " overflows");
    int64_t bytes;
    if (__builtin_mul_overflow(count, esize, &bytes)) fail(name, "the shape " + a.shape_str() + " overflows");
    const size_t data_at = start + header_len;
    if (static_cast<uint64_t>(bytes) != file.size() - data_at)
        fail(name, "the shape " + a.shape_str() + " of " + a.dtype + " needs " + std::to_string(bytes) +
                       " bytes of data, found " + std::to_string(file.size() - data_at));
    a.bytes.assign(file.begin() + static_cast<std::ptrdiff_t>(data_at), file.end());
    return a;
}

Array read_npy(const std::string &path) {
    const auto data = read_file(path);
    return parse_npy(path, data);
}

namespace {

void check_shape(const std::string &name, const Array &a, const std::vector<int64_t> &shape) {
    bool ok = a.shape.size() == shape.size();
    for (size_t i = 0; ok && i < shape.size(); ++i) ok = shape[i] < 0 || shape[i] == a.shape[i];
    if (!ok) fail(name, "expected shape " + shape_str(shape) + ", found " + a.shape_str());
}

} // namespace

std::vector<float> to_floats(const std::string &name, const Array &a, const std::vector<int64_t> &shape) {
    if (a.dtype != "<f4") fail(name, "expected dtype float32 ('<f4'), found '" + a.dtype + "'");
    check_shape(name, a, shape);
    std::vector<float> v(static_cast<size_t>(a.count()));
    if (!v.empty()) std::memcpy(v.data(), a.bytes.data(), v.size() * sizeof(float));
    return v;
}

std::vector<uint8_t> to_bools(const std::string &name, const Array &a, const std::vector<int64_t> &shape) {
    if (a.dtype != "|b1" && a.dtype != "|u1")
        fail(name, "expected dtype bool or uint8, found '" + a.dtype + "'");
    check_shape(name, a, shape);
    std::vector<uint8_t> v(a.bytes.size());
    for (size_t i = 0; i < v.size(); ++i) v[i] = a.bytes[i] != 0;
    return v;
}

void write_npy(const std::string &path, const std::vector<int64_t> &shape, const float *data) {
    std::string shp = "(";
    for (size_t i = 0; i < shape.size(); ++i) shp += (i ? ", " : "") + std::to_string(shape[i]);
    shp += shape.size() == 1 ? ",)" : ")";
    std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': " + shp + ", }";
    const size_t total = 10 + header.size() + 1;
    header += std::string((64 - total % 64) % 64, ' ') + "\n";
    int64_t count = 1;
    for (int64_t d : shape) count *= d;
    const std::string tmp = path + ".tmp";
    {
        std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
        if (!f) fail(path, "cannot create the file");
        const uint8_t pre[10] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0, static_cast<uint8_t>(header.size() & 0xff),
                                 static_cast<uint8_t>(header.size() >> 8)};
        f.write(reinterpret_cast<const char *>(pre), 10);
        f.write(header.data(), static_cast<std::streamsize>(header.size()));
        f.write(reinterpret_cast<const char *>(data), static_cast<std::streamsize>(count * 4));
        if (!f) {
            std::remove(tmp.c_str());
            fail(path, "write error");
        }
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        std::remove(tmp.c_str());
        fail(path, "cannot rename the finished file into place");
    }
}

} // namespace mha::io
