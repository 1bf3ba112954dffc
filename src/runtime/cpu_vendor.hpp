// The CPU's vendor, for the defaults that depend on whose cores they are.
#pragma once

namespace mha::detail {

// AMD's cores: cpuid's vendor "AuthenticAMD", or "HygonGenuine" (Hygon's cores are AMD's Zen).
bool amd_cores();

} // namespace mha::detail
