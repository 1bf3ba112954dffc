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
