// Instruction sets the kernels are compiled for; one is picked per runtime, at run time.
#pragma once

#include <optional>
#include <string_view>
#include <vector>

namespace mha {

enum class Isa { avx2, avx512 };

std::string_view isa_name(Isa isa);
std::optional<Isa> parse_isa(std::string_view name);
bool cpu_supports(Isa isa);
// Every ISA this CPU supports, best last.
std::vector<Isa> supported_isas();
// The best ISA this CPU supports (throws Error(unsupported) if none: the CPU lacks AVX2+FMA).
Isa best_isa();

} // namespace mha
