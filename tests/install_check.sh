#!/usr/bin/env bash
# Installs the build into a staging directory, then builds a plain C program exactly as a user
# would (cc prog.c $(pkg-config --cflags --libs mha)) against the installed files, and runs it.
set -euo pipefail
build_dir=$1
example=$2
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
meson install -C "$build_dir" --destdir "$stage" --no-rebuild --quiet >/dev/null
pc=$(dirname "$(find "$stage" -name mha.pc | head -1)")
[ -n "$pc" ] || { echo "mha.pc was not installed"; exit 1; }
export PKG_CONFIG_PATH=$pc PKG_CONFIG_SYSROOT_DIR=$stage
for h in mha.h gemm.hpp runtime.hpp attention.hpp layer.hpp tile_config.hpp; do
    [ -f "$(find "$stage" -path "*/include/mha/$h" | head -1)" ] || { echo "include/mha/$h not installed"; exit 1; }
done
for tool in mha-bench mha-tune mha-run; do
    [ -x "$(find "$stage" -path "*/bin/$tool" | head -1)" ] || { echo "$tool not installed"; exit 1; }
done
[ -f "$(find "$stage" -path "*/share/mha/torch_layer.py" | head -1)" ] || { echo "share/mha/torch_layer.py not installed"; exit 1; }
[ -f "$(find "$stage" -path "*/share/mha/torch_encoder.py" | head -1)" ] || { echo "share/mha/torch_encoder.py not installed"; exit 1; }
[ -f "$(find "$stage" -path "*/share/mha/torch_anchor.py" | head -1)" ] || { echo "share/mha/torch_anchor.py not installed"; exit 1; }
# The Python package, when the build has it (python3-pybind11 present).
if [ -n "$(find "$build_dir/python/mha" -name '_mha*.so' 2>/dev/null | head -1)" ]; then
    [ -f "$(find "$stage" -path "*/mha/__init__.py" | head -1)" ] || { echo "the python package mha was not installed"; exit 1; }
    [ -f "$(find "$stage" -path "*/mha/_mha*.so" | head -1)" ] || { echo "the python extension mha._mha was not installed"; exit 1; }
fi
cc "$example" -o "$stage/prog" $(pkg-config --cflags --libs mha) -lm
libdir=$(dirname "$(find "$stage" -name 'libmha.so' | head -1)")
LD_LIBRARY_PATH=$libdir "$stage/prog"

# The sharded layer (-Dmpi builds): mha_tp.h compiles as C99 against the installed mha_tp.pc and
# libmha_tp links and runs (mha_tp_shard_for needs no MPI_Init, so no mpirun).
tp_pc=$(find "$stage" -name mha_tp.pc | head -1)
if [ -n "$tp_pc" ]; then
    for h in mha_tp.h tp_layer.hpp; do
        [ -f "$(find "$stage" -path "*/include/mha/$h" | head -1)" ] || { echo "include/mha/$h not installed"; exit 1; }
    done
    cat > "$stage/tp.c" <<'EOF'
#include <mha/mha_tp.h>
int main(void) {
    mha_layer_config cfg = {0};
    mha_tp_shard s;
    cfg.embed_dim = 64;
    cfg.num_heads = 8;
    cfg.num_kv_heads = 2;
    if (mha_tp_shard_for(&cfg, 1, 2, &s) != MHA_OK || s.head_begin != 4 || s.num_kv_heads != 1) return 1;
    return mha_tp_shard_for(&cfg, 0, 4, &s) == MHA_INVALID_ARGUMENT ? 0 : 1;
}
EOF
    # MPI's own flags come from outside the staging sysroot (the sysroot prefixes every package's paths).
    mpi_pcs=$(sed -n 's/^Requires: *//p' "$tp_pc" | tr ', ' '\n\n' | grep -v -e '^mha$' -e '^$' || true)
    cc -std=c99 -Wall -pedantic "$stage/tp.c" -o "$stage/tp" $(pkg-config --cflags --libs mha_tp) \
        $(PKG_CONFIG_SYSROOT_DIR= pkg-config --cflags --libs $mpi_pcs)
    LD_LIBRARY_PATH=$libdir "$stage/tp"
fi
