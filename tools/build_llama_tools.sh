#!/usr/bin/env bash
# Build llama.cpp's own command-line tools (llama-speculative, llama-speculative-simple,
# llama-bench) from the source vendored in the llama-cpp-python sdist that tools/setup.sh installs,
# with the same CMake flags as the engine, so the engine benchmark races wisv_ros against
# llama.cpp's speculative decoding on the same code.
#
#   bash tools/build_llama_tools.sh          # prints the folder holding the binaries
#
# Idempotent: the binaries go to .venv/llama-tools/<version>/bin and are rebuilt only when the
# version, the CMake flags or the CPU change (a stamp beside them). Takes 4-8 minutes on 2 cores.
# Not part of the default setup: only engine_bench's `--llama-speculative` row needs it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
# shellcheck source=setup.sh
source <(sed -n '/^LLAMA_CPP=/p' "$ROOT/tools/setup.sh")
VERSION="${LLAMA_CPP#*==}"
OUT="$VENV/llama-tools/$VERSION"
TARGETS=(llama-speculative llama-speculative-simple llama-bench)

say() { printf 'build_llama_tools: %s\n' "$*" >&2; }
die() { printf 'build_llama_tools: ERROR: %s\n' "$*" >&2; exit 1; }

[[ -x "$VENV/bin/python" ]] || die "no $VENV; run 'bash tools/setup.sh' first"
command -v cmake >/dev/null || die "cmake not found; install it (apt install cmake) and rerun"

# The CMake flags and CPU signature are the engine step's (one definition, in setup.sh).
# shellcheck disable=SC1090
source <(sed -n '/^cpu_signature()/,/^}/p; /^engine_cmake_args()/,/^}/p' "$ROOT/tools/setup.sh")
STAMP_WANT="$VERSION $(engine_cmake_args) $(cpu_signature)"
built() {
  [[ -f "$OUT/stamp" && "$(cat "$OUT/stamp")" == "$STAMP_WANT" ]] || return 1
  local t
  for t in "${TARGETS[@]}"; do [[ -x "$OUT/bin/$t" ]] || return 1; done
}
if built; then
  echo "$OUT/bin"
  exit 0
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/llama-tools.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
say "downloading the $LLAMA_CPP sdist"
"$VENV/bin/python" -m pip download --quiet --no-binary :all: --no-deps "$LLAMA_CPP" -d "$WORK" \
  || die "could not download the $LLAMA_CPP sdist (network or PyPI index)"
tar xzf "$WORK"/llama_cpp_python-*.tar.gz -C "$WORK"
SRC="$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)"
[[ -f "$SRC/CMakeLists.txt" ]] || die "no vendored llama.cpp in the sdist ($SRC)"

say "configuring ($(engine_cmake_args))"
# shellcheck disable=SC2046
cmake -S "$SRC" -B "$WORK/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF \
  $(engine_cmake_args) >"$WORK/configure.log" 2>&1 || { tail -30 "$WORK/configure.log" >&2; die "cmake configure failed"; }
say "building ${TARGETS[*]} (a few minutes)"
cmake --build "$WORK/build" --target "${TARGETS[@]}" -j "$(nproc)" >"$WORK/build.log" 2>&1 \
  || { tail -30 "$WORK/build.log" >&2; die "build failed"; }
mkdir -p "$OUT/bin"
for t in "${TARGETS[@]}"; do cp "$WORK/build/bin/$t" "$OUT/bin/"; done
echo "$STAMP_WANT" >"$OUT/stamp"
echo "$OUT/bin"
