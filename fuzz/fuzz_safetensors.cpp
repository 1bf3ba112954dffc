// libFuzzer target: the .safetensors reader (tools/io/safetensors.hpp). Any input must either parse,
// with every tensor readable and its bytes matching its shape and dtype, or throw
// mha::io::FileError; never crash, throw anything else, or read outside the input (ASan).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "io/safetensors.hpp"

namespace {

[[noreturn]] void fail(const char *what) {
    std::fprintf(stderr, "mha-fuzz: safetensors: %s\n", what);
    __builtin_trap();
}

int64_t element_size(const std::string &d) {
    if (d == "<f4" || d == "<i4") return 4;
    if (d == "<f8" || d == "<i8") return 8;
    if (d == "|b1" || d == "|u1") return 1;
    return 0;
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    std::vector<uint8_t> file(data, data + size);
    try {
        const auto st = mha::io::SafeTensors::parse("fuzz.safetensors", std::move(file));
        uint64_t total = 0;
        for (const auto &key : st.keys()) {
            if (!st.contains(key)) fail("keys() lists a key that contains() denies");
            const mha::io::Array a = st.get(key);
            const int64_t esize = element_size(a.dtype);
            if (!esize) fail("a tensor has an unsupported dtype");
            for (int64_t d : a.shape)
                if (d < 0) fail("a negative dimension");
            if (static_cast<uint64_t>(a.count()) * static_cast<uint64_t>(esize) != a.bytes.size())
                fail("a tensor's bytes do not match its shape");
            total += a.bytes.size();
        }
        if (total > size) fail("the tensors hold more bytes than the file");  // they may not overlap
        try {
            (void)st.get("\x01not a key");
            fail("get() of a missing key did not throw");
        } catch (const mha::io::FileError &) {
        }
    } catch (const mha::io::FileError &e) {
        if (!*e.what()) fail("an empty error message");
    }
    return 0;
}
