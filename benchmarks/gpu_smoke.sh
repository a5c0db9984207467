#!/usr/bin/env bash
# GPU smoke of the product's GPU path on one GPU, ~7 minutes on an H200 (docs/gpu.md). From anywhere:
#   ./benchmarks/gpu_smoke.sh               # set up .venv with a CUDA torch (scripts/setup.sh), run every step
#   ./benchmarks/gpu_smoke.sh --cpu         # every step that can run on CPU, gpt_tiny (rehearsal, ~2 min)
#   ./benchmarks/gpu_smoke.sh --dry-run     # the plumbing only, CUDA steps "skipped" (~30 s)
#   ./benchmarks/gpu_smoke.sh --only ddp_mfu,resume
# One JSON line per step on stdout, also in $OUT/gpu_smoke.jsonl (else benchmarks/out/); logs beside it.
#
# On a machine with its own torch and no network (the lent GPU machines): carry the folder of wheels
# benchmarks/gpu_wheels.sh builds (.whl/, ~24 MiB: hydra, omegaconf, submitit, deepspeed, ...). When it
# is there (SMOKE_WHEELS=dir: another) and a Python here has torch (a CUDA one in GPU mode), the wheels
# are installed into a scratch dir put on PYTHONPATH, with no index, and setup.sh is skipped; the
# "setup" line names the Python, its torch and the wheels. The whole smoke has a budget (--budget-s,
# default 450 s from this script's start): a step is cut to what is left, or "skipped: budget".
#
# Set-up otherwise (GPU mode only): scripts/setup.sh (PyPI's torch is a CUDA build; LAUNCHER_TORCH_INDEX,
# LAUNCHER_TORCH_SPEC where a mirror holds only +cpu ones), pip told to give up quickly with no network. If that fails
# (no network: a CUDA torch cannot be installed), the "setup" line says so and the steps run with the
# first Python found whose torch imports (.venv, then python3; SMOKE_PYTHON overrides), each step
# saying what it lacks. SMOKE_SITE=dir1:dir2 puts extra package dirs (pure-Python packages that
# Python lacks: hydra, omegaconf, submitit, ...) on PYTHONPATH. SMOKE_SKIP_SETUP=1: no setup.sh.
set -uo pipefail
export SMOKE_T0="${SMOKE_T0:-$(date +%s)}"
cd "$(dirname "$0")/.."
MODE=gpu
REST=()
for a in "$@"; do case "$a" in --cpu) MODE=cpu ;; --dry-run) MODE=dry-run ;; *) REST+=("$a") ;; esac; done
OUTDIR="${OUT:-benchmarks/out}"
mkdir -p "$OUTDIR"
SETUP_LOG="$OUTDIR/gpu_smoke_setup.log"
SETUP_JSON="$OUTDIR/gpu_smoke_setup.json"
[ -n "${SMOKE_SITE:-}" ] && export PYTHONPATH="$SMOKE_SITE${PYTHONPATH:+:$PYTHONPATH}"

has_torch() { "$1" -c 'import torch' >/dev/null 2>&1; }
has_cuda() { "$1" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' >/dev/null 2>&1; }

# the Python the steps run with: the first whose torch imports (a CUDA one in GPU mode, else any)
pick_python() {
  local cand found=""
  for cand in .venv/bin/python python3; do
    command -v "$cand" >/dev/null 2>&1 || [ -x "$cand" ] || continue
    if has_torch "$cand" && { [ "$MODE" != gpu ] || has_cuda "$cand"; }; then echo "$cand"; return; fi
    [ -z "$found" ] && has_torch "$cand" && found="$cand"   # torch without CUDA: still better than none
  done
  echo "${found:-python3}"
}

WHEELS="${SMOKE_WHEELS:-.whl}"
wheels=""
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  PY="${SMOKE_PYTHON:-$(pick_python)}"
  if has_torch "$PY" && { [ "$MODE" != gpu ] || has_cuda "$PY"; }; then
    site="${SMOKE_SITE_DIR:-${TMPDIR:-/tmp}/gpu_smoke_site}"
    rm -rf "$site"
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$WHEELS"/*.whl >"$SETUP_LOG" 2>&1; then
      export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
      wheels="$(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into $site"
      SMOKE_SKIP_SETUP=1
    else
      echo "gpu_smoke: installing the carried wheels ($WHEELS) failed: $(tail -2 "$SETUP_LOG")" >&2
    fi
  fi
fi

setup_rc=-1; setup_s=0; why=""
if [ "$MODE" = gpu ] && [ "${SMOKE_SKIP_SETUP:-0}" != 1 ]; then
  t0=$SECONDS
  # no network: pip fails in seconds, not after minutes of retries
  PIP_RETRIES="${PIP_RETRIES:-1}" PIP_TIMEOUT="${PIP_TIMEOUT:-15}" timeout "${SMOKE_SETUP_TIMEOUT:-600}" \
    ./scripts/setup.sh >"$SETUP_LOG" 2>&1
  setup_rc=$?; setup_s=$((SECONDS - t0))
  if [ $setup_rc -ne 0 ]; then
    if grep -q "torch is a CPU build" "$SETUP_LOG"; then
      why="a CUDA torch is not installable here: pip found only a CPU build (its sources hold +cpu wheels: setup.sh's log says what to set)"
    elif grep -qiE "network|connection|resolve|Temporary failure|No matching distribution|Could not find a version" "$SETUP_LOG"; then
      why="a CUDA torch is not installable here: pip could not reach ${LAUNCHER_TORCH_INDEX:-PyPI} (no network?)"
    elif [ $setup_rc -eq 124 ]; then
      why="scripts/setup.sh timed out after ${SMOKE_SETUP_TIMEOUT:-600} s"
    else
      why="scripts/setup.sh failed (exit $setup_rc): see the log's tail"
    fi
    echo "gpu_smoke: SETUP FAILED: $why; running what the Python found here can run" >&2
  fi
fi

[ -n "$wheels" ] || PY="${SMOKE_PYTHON:-$(pick_python)}"

"$PY" - "$MODE" "$setup_rc" "$setup_s" "$why" "$SETUP_LOG" "$PY" "$wheels" >"$SETUP_JSON" <<'EOF'
import json, os, sys
mode, rc, secs, why, log, py, wheels = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5],
                                        sys.argv[6], sys.argv[7])
tail = open(log, errors="replace").read().strip().splitlines()[-6:] if os.path.exists(log) else []
try:
    import torch
    torch_v = f"{torch.__version__} (CUDA {torch.version.cuda}, available {torch.cuda.is_available()})"
except Exception as e:
    torch_v = f"import failed: {e}"
measured = {"setup_exit": None if rc < 0 else rc, "setup_s": secs, "python": py, "torch": torch_v,
            "LAUNCHER_TORCH_INDEX": os.environ.get("LAUNCHER_TORCH_INDEX"),
            "LAUNCHER_TORCH_SPEC": os.environ.get("LAUNCHER_TORCH_SPEC", "torch==2.13.0 (setup.sh default)"),
            "wheels": wheels or None}
expected = "scripts/setup.sh exit 0: .venv with a CUDA build of torch"
if rc < 0:
    res = {"step": "setup", "ok": None, "measured": measured, "expected": expected,
           "why": f"skipped: this Python's torch with the carried wheels ({wheels})" if wheels
           else f"skipped: {mode} mode" if mode != "gpu" else "skipped: SMOKE_SKIP_SETUP=1"}
else:
    res = {"step": "setup", "ok": rc == 0, "measured": measured, "expected": expected,
           **({"why": why, "tail": [x[-300:] for x in tail]} if rc else {})}
print(json.dumps(res))
EOF
exec "$PY" benchmarks/gpu_smoke.py --mode "$MODE" --setup-json "$SETUP_JSON" ${REST[@]+"${REST[@]}"}
