#include "gemm/transpose_variant.hpp"

#include <cpuid.h>

#include <cstdlib>
#include <string>

#include "mha/error.hpp"

namespace mha::gemm {

TransposeVariant default_transpose_variant() {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return TransposeVariant::inserts;
    const bool amd = b == 0x68747541 && d == 0x69746e65 && c == 0x444d4163;    // "AuthenticAMD"
    const bool hygon = b == 0x6f677948 && d == 0x6e65476e && c == 0x656e6975;  // "HygonGenuine": AMD's Zen cores
    return amd || hygon ? TransposeVariant::shuffles : TransposeVariant::inserts;
}

std::atomic<int> g_transpose_variant{static_cast<int>(default_transpose_variant())};

void set_transpose_variant(TransposeVariant v) { g_transpose_variant.store(static_cast<int>(v), std::memory_order_relaxed); }

const char *transpose_variant_name(TransposeVariant v) { return v == TransposeVariant::inserts ? "inserts" : "shuffles"; }

std::optional<TransposeVariant> parse_transpose_variant(std::string_view name) {
    if (name == "shuffles") return TransposeVariant::shuffles;
    if (name == "inserts") return TransposeVariant::inserts;
    return std::nullopt;
}

void apply_transpose_env() {
    const char *env = std::getenv("MHA_TRANSPOSE");
    if (!env || !*env) return;
    const auto v = parse_transpose_variant(env);
    if (!v) invalid_argument(std::string("MHA_TRANSPOSE='") + env + "' is not one of shuffles, inserts");
    set_transpose_variant(*v);
}

} // namespace mha::gemm
