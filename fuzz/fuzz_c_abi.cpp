// libFuzzer target: the C ABI (include/mha/mha.h). The first byte picks an entry point; the rest
// decodes its arguments (see c_abi_fuzz.hpp for the rules every call is held to, and
// c_abi_entries.cpp / c_abi_layer.cpp for each entry's decoder and reference).
#include <cstdlib>

#include "c_abi_fuzz.hpp"

namespace fuzz {

mha_runtime *runtime(int which) {
    static mha_runtime *rts[2] = {nullptr, nullptr};
    if (!rts[which]) {
        if (mha_runtime_create(which + 1, &rts[which]) != MHA_OK) {
            std::fprintf(stderr, "mha-fuzz: cannot create a runtime: %s\n", mha_last_error());
            std::abort();
        }
    }
    return rts[which];
}

} // namespace fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    using namespace fuzz;
    Input in(data, size);
    try {
        switch (in.byte() % 10) {
        case 0: fuzz_sgemm(in); break;
        case 1: fuzz_softmax(in); break;
        case 2: fuzz_attention(in); break;
        case 3: fuzz_varlen(in); break;
        case 4: fuzz_kv_cache(in); break;
        case 5: fuzz_layer(in); break;
        case 6: fuzz_layer_cached(in); break;
        case 7: fuzz_encoder(in); break;
        case 8: fuzz_misc(in); break;
        default: fuzz_attention(in); break;
        }
    } catch (const Skip &) {
    }
    return 0;
}
