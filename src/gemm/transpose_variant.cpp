#include "gemm/transpose_variant.hpp"

#include <cstdlib>
#include <string>

#include "mha/error.hpp"

namespace mha::gemm {

const char *transpose_variant_name(TransposeVariant v) {
    return v == TransposeVariant::inserts ? "inserts" : "shuffles";
}

std::optional<TransposeVariant> parse_transpose_variant(std::string_view name) {
    if (name == "shuffles") return TransposeVariant::shuffles;
    if (name == "inserts") return TransposeVariant::inserts;
    return std::nullopt;
}

void apply_transpose_env(std::string &transpose) {
    const char *env = std::getenv("MHA_TRANSPOSE");
    if (!env || !*env) return;
    if (!parse_transpose_variant(env))
        invalid_argument(std::string("MHA_TRANSPOSE='") + env + "' is not one of shuffles, inserts");
    transpose = env;
}

} // namespace mha::gemm
