#!/usr/bin/env bash
# The folder of wheels a GPU machine with no network needs for benchmarks/gpu_smoke.sh: every package
# the smoke imports but torch and what torch brings (hydra-core, omegaconf, antlr4, submitit, deepspeed,
# pydantic, numpy, rich, ...), at the versions this checkout's .venv tested, for that machine's Python
# (x86-64 manylinux). Built here (PyPI is reachable here), carried there; gpu_smoke.sh installs it
# into a scratch site when it finds it (docs/gpu.md).
#   ./benchmarks/gpu_wheels.sh                       # .whl/ for CPython 3.12 (the lent GPU machines')
#   ./benchmarks/gpu_wheels.sh --python-version 3.11 --dest DIR
# Prints the folder's size; fails past 64 MiB (what one device call carries). wandb is not carried:
# the smoke's launches run with wandb.enabled=false (docs/gpu.md says why).
set -euo pipefail
cd "$(dirname "$0")/.."
PYV=3.12 DEST=.whl
while [ $# -gt 0 ]; do
  case "$1" in
    --python-version) PYV="$2"; shift 2 ;;
    --dest) DEST="$2"; shift 2 ;;
    *) echo "gpu_wheels: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -x .venv/bin/python ] || ./scripts/setup.sh
PY=.venv/bin/python
mkdir -p "$DEST"
rm -f "$DEST"/*.whl
# name==version of every distribution the smoke needs beyond torch's own closure, as .venv holds them
mapfile -t WANT < <("$PY" benchmarks/dist_closure.py wheels)
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  PLATFORMS+=(--platform "$p")
done
for req in "${WANT[@]}"; do
  # a binary for that Python and platform where PyPI has one; else (antlr4, deepspeed: sources only) a
  # wheel built here from the sources, pure Python (DeepSpeed's ops are compiled on first use there)
  if ! "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
      "${PLATFORMS[@]}" -d "$DEST" "$req" 2>/dev/null; then
    DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w "$DEST" "$req"
  fi
done
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "gpu_wheels: ${#WANT[@]} packages for CPython $PYV in $DEST: $((bytes / 1024 / 1024)) MiB ($bytes bytes)"
ls "$DEST"
if [ "$bytes" -gt $((64 * 1024 * 1024)) ]; then
  echo "gpu_wheels: over the 64 MiB one device call carries" >&2
  exit 1
fi
