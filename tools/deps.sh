# Sourced by tools/test and tools/run: makes sure every Debian package the build needs is installed.
MHA_PACKAGES=(meson ninja-build g++ pkg-config cmake libxsimd-dev libtbb-dev doctest-dev libbenchmark-dev
              nlohmann-json3-dev libdnnl-dev libopenblas-dev python3-dev python3-pybind11 python3-pytest python3-numpy
              python3-torch clang-16 libclang-rt-16-dev
              libopenmpi-dev openmpi-bin)

# The oracle for golden files and fits in tests/data/ (the C++ tests never need it; the Python
# tests of mha.torch do, so MHA_PACKAGES has it too): tools/goldens.
MHA_ORACLE_PACKAGES=(python3-numpy python3-torch)

ensure_packages() {  # ensure_packages [PACKAGE...]: MHA_PACKAGES by default
    local missing=() wanted=("$@")
    [ ${#wanted[@]} -eq 0 ] && wanted=("${MHA_PACKAGES[@]}")
    for p in "${wanted[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    if [ "$(id -u)" -ne 0 ]; then
        echo "missing packages; run as root:" >&2
        echo "  apt-get update && apt-get install -y ${missing[*]}" >&2
        exit 1
    fi
    echo "installing: ${missing[*]}" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
}

# meson_build DIR [meson options...]: configure DIR once (reused when it exists), then compile.
meson_build() {
    local dir=$1
    shift
    if [ -f "$dir/build.ninja" ]; then
        meson configure "$dir" "$@" >/dev/null
    else
        meson setup "$dir" "$@" >&2
    fi
    meson compile -C "$dir" >&2
}

# clang_sanitize_build DIR [meson options...]: the sanitizer build of tools/test and tools/fuzz:
# clang-16, ASan+UBSan, the libFuzzer targets of fuzz/ (and -fsanitize=fuzzer-no-link on
# everything). A DIR configured with another compiler (an older gcc build-sanitize) is set up afresh.
# Debug information is line tables only (-gline-tables-only after debugoptimized's -g): the
# sanitizers' reports keep every file and line, and the build takes about a sixth less time
# (clang-16, attention's AVX-512 kernels 197 s -> 162 s, test_serving 40 s -> 35 s).
clang_sanitize_build() {
    local dir=$1
    shift
    if [ -f "$dir/build.ninja" ] && ! grep -q 'clang++' "$dir/build.ninja"; then
        echo "$dir was configured with another compiler; setting it up again with clang-16" >&2
        rm -rf "$dir"
    fi
    CC=clang-16 CXX=clang++-16 meson_build "$dir" -Db_sanitize=address,undefined -Db_lundef=false -Dfuzzers=enabled \
        -Dbenchmarks=false -Dbuildtype=debugoptimized -Dcpp_args=-gline-tables-only "$@"
}

# tools/tsan (tools/test --tsan): downloads Debian's oneTBB source and builds it with
# -fsanitize=thread (cmake, ninja), on top of MHA_PACKAGES.
MHA_TSAN_PACKAGES=(curl ca-certificates xz-utils cmake ninja-build g++ libtsan2)
