// CPU feature detection. __builtin_cpu_supports reads cpuid and also checks that the OS saves the
// wide registers (XCR0), so a "yes" here means the kernels can run.
#include "mha/isa.hpp"

#include <cpuid.h>

#include "mha/error.hpp"
#include "runtime/cpu_vendor.hpp"

namespace mha {

std::string_view isa_name(Isa isa) { return isa == Isa::avx512 ? "avx512" : "avx2"; }

std::optional<Isa> parse_isa(std::string_view name) {
    if (name == "avx2") return Isa::avx2;
    if (name == "avx512") return Isa::avx512;
    return std::nullopt;
}

bool cpu_supports(Isa isa) {
    __builtin_cpu_init();
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (isa == Isa::avx2) return avx2;
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
}

std::vector<Isa> supported_isas() {
    std::vector<Isa> v;
    for (Isa isa : {Isa::avx2, Isa::avx512})
        if (cpu_supports(isa)) v.push_back(isa);
    return v;
}

Isa best_isa() {
    const auto v = supported_isas();
    if (v.empty()) throw Error(Status::unsupported, "mha needs a CPU with AVX2 and FMA");
    return v.back();
}

namespace detail {

bool amd_cores() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;    // "AuthenticAMD"
    const bool hygon = b == 0x6f677948 && d == 0x6e65476e && c == 0x656e6975;  // "HygonGenuine"
    return amd || hygon;
}

} // namespace detail
} // namespace mha
