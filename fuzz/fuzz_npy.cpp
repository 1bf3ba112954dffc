// libFuzzer target: the .npy reader (tools/io/npy.hpp). Any input must either parse into an array
// whose bytes match its shape and dtype, or throw mha::io::FileError; never crash or read outside
// the input (ASan). A parsed array is also converted as the tools do (to_floats / to_bools).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <span>
#include <vector>

#include "io/npy.hpp"

namespace {

[[noreturn]] void fail(const char *what) {
    std::fprintf(stderr, "mha-fuzz: npy: %s\n", what);
    __builtin_trap();
}

int64_t element_size(const std::string &d) {
    if (d == "<f4" || d == "<i4" || d == "<u4") return 4;
    if (d == "<f8" || d == "<i8" || d == "<u8") return 8;
    if (d == "|b1" || d == "|u1" || d == "|i1") return 1;
    return 0;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    mha::io::Array a;
    try {
        a = mha::io::parse_npy("fuzz.npy", std::span<const uint8_t>(data, size));
    } catch (const mha::io::FileError &e) {
        if (!*e.what()) fail("an empty error message");
        return 0;
    }
    const int64_t esize = element_size(a.dtype);
    if (!esize) fail("parsed an unsupported dtype");
    for (int64_t d : a.shape)
        if (d < 0) fail("parsed a negative dimension");
    if (static_cast<uint64_t>(a.count()) * static_cast<uint64_t>(esize) != a.bytes.size())
        fail("the data does not match the shape");
    (void)a.shape_str();
    const std::vector<int64_t> any(a.shape.size(), -1);
    try {
        const auto f = mha::io::to_floats("fuzz.npy", a, any);
        if (f.size() * 4 != a.bytes.size()) fail("to_floats returned the wrong count");
    } catch (const mha::io::FileError &) {
        if (a.dtype == "<f4") fail("to_floats refused a float32 array of the right rank");
    }
    try {
        const auto b = mha::io::to_bools("fuzz.npy", a, any);
        for (uint8_t x : b)
            if (x > 1) fail("to_bools returned a value other than 0 or 1");
    } catch (const mha::io::FileError &) {
    }
    // A wrong rank is refused.
    try {
        (void)mha::io::to_floats("fuzz.npy", a, std::vector<int64_t>(a.shape.size() + 1, -1));
        fail("to_floats accepted a wrong rank");
    } catch (const mha::io::FileError &) {
    }
    return 0;
}
