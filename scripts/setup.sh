#!/usr/bin/env bash
# Create .venv in the repo and install the project with its dependencies (idempotent).
# torch is pinned and installed in the same pip command as everything that depends on it:
# on a machine without a GPU, torch==2.13.0 is a CPU build; unpinned, deepspeed would pull
# a multi-GB CUDA build. On a machine with NVIDIA GPUs (nvidia-smi -L lists them) the build must
# be a CUDA one: PyPI's torch for Linux x86-64 is one, so no other index is needed; where a mirror or a
# wheel folder holds only `+cpu` builds, LAUNCHER_TORCH_INDEX (e.g. https://download.pytorch.org/whl/cu126)
# is added as an index, and setup fails, saying what to set, if torch still comes without CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_SPEC="${LAUNCHER_TORCH_SPEC:-torch==2.13.0}"
PY="${PYTHON:-python3}"
GPUS="$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU ' || true)"
INDEX=()
if [ "$GPUS" -gt 0 ] && [ -n "${LAUNCHER_TORCH_INDEX:-}" ]; then
  INDEX=(--extra-index-url "$LAUNCHER_TORCH_INDEX")
fi

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup: need Python >= 3.10 (set PYTHON=/path/to/python3)" >&2
  exit 1
fi

stamp_want="$( (cat setup.cfg pyproject.toml scripts/setup.sh; echo "gpus=$GPUS") | sha256sum | cut -c1-16)"
if [ -x .venv/bin/python ] && [ "$(cat .venv/.launcher-stamp 2>/dev/null)" = "$stamp_want" ]; then
  exit 0
fi

echo "setup: creating .venv and installing the project (the first time takes 2-5 min on 2 cores: torch, DeepSpeed and their dependencies)"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# DeepSpeed's C++ ops are built on first use (JIT), never at install time. pip compiles what it installs
# on one core; compileall does it on every core (the bytecode is written here once: a process started
# with PYTHONDONTWRITEBYTECODE=1, common in containers, would otherwise compile torch at each import).
DS_BUILD_OPS=0 .venv/bin/python -m pip install -q --no-compile ${INDEX[@]+"${INDEX[@]}"} "$TORCH_SPEC" -e ".[test]"
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
  launcher recipes >/dev/null || true  # (exit 1 for files no Python 3 compiles: some packages ship test data)
cuda="$(.venv/bin/python -c 'import torch; print(torch.version.cuda or "")')"
if [ "$GPUS" -gt 0 ] && [ -z "$cuda" ]; then
  got="$(.venv/bin/python -c 'import torch; print(torch.__version__)')"
  echo "setup: this machine has $GPUS NVIDIA GPU(s) but pip installed torch $got, a CPU build: jobs would train on CPU." >&2
  where="$(.venv/bin/python -m pip config list 2>/dev/null | grep -iE 'index-url|find-links' | tr '\n' ' ')"
  [ -n "${PIP_INDEX_URL:-}${PIP_FIND_LINKS:-}${PIP_EXTRA_INDEX_URL:-}" ] && \
    where="$where PIP_INDEX_URL=${PIP_INDEX_URL:-} PIP_FIND_LINKS=${PIP_FIND_LINKS:-} PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL:-}"
  echo "setup: pip's sources here (${where:-PyPI}) hold a +cpu build; set LAUNCHER_TORCH_SPEC to a CUDA wheel (a file or" \
       "a version your mirror has with CUDA), or LAUNCHER_TORCH_INDEX to an index with CUDA builds" \
       "(e.g. https://download.pytorch.org/whl/cu126), and run again" >&2
  exit 1
fi
echo "$stamp_want" > .venv/.launcher-stamp
.venv/bin/python -c 'import torch, deepspeed, hydra, submitit; print(f"setup: torch {torch.__version__}, deepspeed {deepspeed.__version__}, hydra {hydra.__version__}, submitit {submitit.__version__}")' 2>&1 | grep '^setup:'
if [ -n "$cuda" ]; then
  echo "setup: CUDA build of torch (CUDA $cuda) for the $GPUS GPU(s) of this machine"
else
  echo "setup: CPU build of torch (no NVIDIA GPU on this machine)"
fi
