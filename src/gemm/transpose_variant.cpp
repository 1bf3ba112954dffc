#include "gemm/transpose_variant.hpp"

#include <cstdlib>
#include <string>

#include "mha/error.hpp"
#include "runtime/cpu_vendor.hpp"

namespace mha::gemm {

namespace {
// The CPU's default (see transpose_variant.hpp): shuffles on AMD's cores, inserts elsewhere.
TransposeVariant default_transpose_variant() {
    return mha::detail::amd_cores() ? TransposeVariant::shuffles : TransposeVariant::inserts;
}
} // namespace

// -1 until the first read resolves it to the CPU's default; constant-initialized, so a Runtime
// made during another file's static initialization still finds it (and MHA_TRANSPOSE's value is
// never overwritten by a later initializer).
constinit std::atomic<int> g_transpose_variant{-1};

TransposeVariant resolve_transpose_variant() {
    int expected = -1;
    g_transpose_variant.compare_exchange_strong(expected, static_cast<int>(default_transpose_variant()),
                                                std::memory_order_relaxed);
    return static_cast<TransposeVariant>(g_transpose_variant.load(std::memory_order_relaxed));
}

void set_transpose_variant(TransposeVariant v) {
    g_transpose_variant.store(static_cast<int>(v), std::memory_order_relaxed);
}

const char *transpose_variant_name(TransposeVariant v) {
    return v == TransposeVariant::inserts ? "inserts" : "shuffles";
}

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
