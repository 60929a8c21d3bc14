#!/usr/bin/env bash
# Build FlashKDA (github.com/MoonshotAI/FlashKDA, pinned at commit 1ce47ea: a forward-only CUTLASS
# KDA kernel) in place on the GPU machine, so that `python -m kernel_fun.bench` can time it as the
# third implementation "flashkda" (docs/benchmark.md). Nothing of FlashKDA is in this repository:
# its source travels in the git-ignored folder .flashkda/, and the benchmark only calls its
# Python API (flash_kda.fwd).
#
# 1. Here (once; the GPU machine has no network), from the repository root:
#      mkdir -p .flashkda
#      git -C /work/.mirror/MoonshotAI+FlashKDA/repo archive 1ce47ea | tar -x -C .flashkda
#    (from a clone of the repository instead: git -C <clone> archive 1ce47ea | tar -x -C .flashkda)
# 2. On the device: carry [".whl", ".flashkda"] and run scripts/gpu_run.sh with KF_FLASHKDA=1,
#    which installs the carried wheels (nvidia-cutlass among them), calls this script and puts
#    the folder on PYTHONPATH. By hand, after the wheels are importable:
#      bash scripts/build_flashkda.sh [SRC]          # SRC defaults to .flashkda
#      export PYTHONPATH=$PWD/.flashkda:$PYTHONPATH  # what the script prints on success
#
# FlashKDA's `cutlass` submodule is not in a git archive (an empty folder). SRC/cutlass becomes a
# symlink to the CUTLASS sources shipped in the installed nvidia-cutlass wheel,
# <cutlass_library>/source (include/, tools/util/include, examples/common: the three folders
# FlashKDA's setup.py adds to the include path); a real checkout (SRC/cutlass/include present) is
# left alone. The package is located with importlib.util.find_spec, without importing it (only its
# headers are needed), as our own setup.py does.
#
# FlashKDA's setup.py runs `git submodule update --init cutlass` (unchecked) and `git rev-parse`
# for its version. Inside our tree those would act on kernel_fun's repository, and without git the
# first one raises; the build therefore sees a `git` that only fails, and the version suffix is
# set explicitly (FLASH_KDA_VERSION_SUFFIX, default +1ce47ea).
#
# Environment: FLASH_KDA_CUDA_ARCHS (default 90a: the H200), NVCC_THREADS (FlashKDA's default 32),
# MAX_JOBS. Exit status: 0 built and importable, 1 otherwise (the reason on stderr).
set -u
src="${1:-.flashkda}"
fail() { echo "build_flashkda: $*" >&2; exit 1; }

if [ ! -f "$src/setup.py" ] || [ ! -f "$src/flash_kda/__init__.py" ]; then
  fail "no FlashKDA source tree in '$src' (see this script's header for how to prepare it)"
fi
src="$(cd "$src" && pwd)"

cutlass_src="$(python3 -c '
import importlib.util, os
s = importlib.util.find_spec("cutlass_library")
print(os.path.join(list(s.submodule_search_locations)[0], "source") if s and s.submodule_search_locations else "")
')" || fail "python3 could not look for cutlass_library"
if [ -d "$src/cutlass/include" ] && [ ! -L "$src/cutlass" ]; then
  echo "build_flashkda: using the CUTLASS checkout in $src/cutlass"
else
  [ -n "$cutlass_src" ] || fail "nvidia-cutlass is not installed (no cutlass_library on the python path; gpu_run.sh installs it from .whl/)"
  for d in include tools/util/include examples/common; do
    [ -d "$cutlass_src/$d" ] || fail "$cutlass_src/$d missing: not the nvidia-cutlass wheel layout this script expects"
  done
  if [ -L "$src/cutlass" ]; then
    rm -f "$src/cutlass"
  elif [ -d "$src/cutlass" ]; then
    rmdir "$src/cutlass" 2>/dev/null || fail "$src/cutlass is a non-empty folder without include/: remove it"
  fi
  ln -s "$cutlass_src" "$src/cutlass" || fail "could not link $src/cutlass -> $cutlass_src"
  echo "build_flashkda: $src/cutlass -> $cutlass_src"
fi

nogit="$(mktemp -d)"
trap 'rm -rf "$nogit"' EXIT
printf '#!/bin/sh\necho "git disabled while building FlashKDA (scripts/build_flashkda.sh)" >&2\nexit 1\n' > "$nogit/git"
chmod +x "$nogit/git"

echo "build_flashkda: building in $src (FLASH_KDA_CUDA_ARCHS=${FLASH_KDA_CUDA_ARCHS:-90a})"
( cd "$src" &&
  PATH="$nogit:$PATH" FLASH_KDA_CUDA_ARCHS="${FLASH_KDA_CUDA_ARCHS:-90a}" \
  FLASH_KDA_VERSION_SUFFIX="${FLASH_KDA_VERSION_SUFFIX:-+1ce47ea}" \
  python3 setup.py build_ext --inplace ) || fail "setup.py build_ext failed"

PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}" python3 -c "import flash_kda; flash_kda.fwd" ||
  fail "built, but 'import flash_kda' fails with $src on PYTHONPATH"
echo "build_flashkda: ok. To use it:"
echo "  export PYTHONPATH=$src\${PYTHONPATH:+:\$PYTHONPATH}"
