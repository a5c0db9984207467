#!/usr/bin/env bash
# The GPU smoke rehearsed here on a simulated lent GPU machine: a Python that has torch and nothing else
# of this project's (a venv holding only torch and what torch needs), the folder of wheels
# benchmarks/gpu_wheels.sh builds for this Python, and no network (its own network namespace); then
# benchmarks/gpu_smoke.sh --cpu as a lent machine would run it. Every step runs or says why it skips.
#   ./benchmarks/gpu_smoke_bare.sh [gpu_smoke.sh's arguments]      (root, for the network namespace)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || ./scripts/setup.sh
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
pyv="$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
./benchmarks/gpu_wheels.sh --python-version "$pyv" --dest "$work/whl" | tail -1
# torch and its own needs, from this checkout's .venv (the lent machine brings its own torch)
"$(readlink -f .venv/bin/python)" -m venv "$work/venv"
site="$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$work/torch"
.venv/bin/python benchmarks/dist_closure.py link-torch "$work/torch"
echo "$work/torch" > "$site/torch_only.pth"
if "$work/venv/bin/python" -c 'import hydra' 2>/dev/null; then
  echo "gpu_smoke_bare: the simulated machine's Python finds hydra: not bare" >&2
  exit 1
fi
echo "gpu_smoke_bare: $("$work/venv/bin/python" -c 'import torch, sys; print("Python", sys.version.split()[0], "torch", torch.__version__)'), no network"
# a network namespace of its own with only its loopback up (the ranks' rendezvous), as on a machine
# that reaches nothing outside
unshare --net env SMOKE_WHEELS="$work/whl" SMOKE_PYTHON="$work/venv/bin/python" SMOKE_SITE_DIR="$work/site" \
  TMPDIR="$work" sh -c 'ip link set lo up && exec ./benchmarks/gpu_smoke.sh --cpu "$@"' sh "$@"
