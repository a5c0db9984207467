#!/usr/bin/env bash
# Fresh machine -> set up, start the real local Slurm cluster, run the whole test suite.
#   ./scripts/test.sh            the whole suite (what CI runs): pure tier, then the integration tier
#   ./scripts/test.sh --fast     the pure tier only (tests/unit: no process, no Slurm, no browser set up)
# Extra args go to pytest (e.g. ./scripts/test.sh tests/unit -x, ./scripts/test.sh --fast -k layout).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh

if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -q -ra -m "not launch" "${@:-tests/unit}"
fi

started_slurm=0
if ! ./scripts/slurm-local.sh status >/dev/null 2>&1; then
  ./scripts/slurm-local.sh up
  started_slurm=1
fi
eval "$(./scripts/slurm-local.sh env)"
cleanup() { [ "$started_slurm" = 1 ] && ./scripts/slurm-local.sh down >/dev/null 2>&1 || true; }
trap cleanup EXIT

# the report's browser test (Debian's chromium, headless)
LAUNCHER_CHROMIUM="$(./scripts/browser.sh)"
export LAUNCHER_CHROMIUM LAUNCHER_REQUIRE_BROWSER=1

LAUNCHER_REQUIRE_SLURM=1 .venv/bin/python -m pytest -q -ra --durations=25 "${@:-tests}"
