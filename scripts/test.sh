#!/usr/bin/env bash
# Fresh machine -> set up, start the real local Slurm cluster, run the whole test suite.
#   ./scripts/test.sh            the whole suite (what CI runs): the pure tier, then the integration tier
#   ./scripts/test.sh --fast     the pure tier only (tests/unit: nothing launched, no Slurm or browser set up)
#   ./scripts/test.sh --fast ARGS  pytest ARGS, no Slurm or browser set up: options alone keep tests/unit
#                                (--fast -x, --fast -k asha); a path among them is run instead of it
#   ./scripts/test.sh ARGS...    pytest ARGS with everything set up (e.g. tests/integration/test_truth.py -x)
#   LAUNCHER_TEST_REPORTS=DIR ./scripts/test.sh   also write each tier's JUnit XML (DIR/unit.xml,
#                                DIR/integration.xml): scripts/flakes.py --from reads them
#   LAUNCHER_TEST_WORKERS=N ./scripts/test.sh      the integration tier on N workers (default 3)
# docs/testing.md: the tiers, the two workers, and the time budget.
set -euo pipefail
cd "$(dirname "$0")/.."
# bytecode is cached, as on most users' machines: with PYTHONDONTWRITEBYTECODE=1 (set in many containers)
# every process compiles again whatever setup.sh did not compile (a module changed since, the tests, the
# programs the tests write), and pytest rewrites every test module in each worker
unset PYTHONDONTWRITEBYTECODE

# The cluster and the browser come up beside the venv's install (neither needs it; pip waits on the
# network and the disk, half of the two cores idle): one background job, so their apt-get installs
# run one after the other. Its output is shown once it ends.
bringup_pid="" bringup_log="" build_pid=""
if [ "${1:-}" != "--fast" ]; then
  bringup_log="$(mktemp)"
  {
    if ! ./scripts/slurm-local.sh status >/dev/null 2>&1; then
      ./scripts/slurm-local.sh up && echo "started" > "$bringup_log.started"
    fi
    ./scripts/browser.sh > "$bringup_log.chromium"
  } > "$bringup_log" 2>&1 &
  bringup_pid=$!
fi
cleanup() {
  [ -n "$bringup_pid" ] && kill "$bringup_pid" 2>/dev/null || true
  [ -n "$build_pid" ] && kill "$build_pid" 2>/dev/null || true
  [ -f "${bringup_log}.started" ] && ./scripts/slurm-local.sh down >/dev/null 2>&1 || true
  [ -n "$bringup_log" ] && rm -f "$bringup_log" "$bringup_log.started" "$bringup_log.chromium"
}
trap cleanup EXIT

# the cluster and the browser, once up (their output first); exits naming what failed
await_bringup() {
  local rc=0
  wait "$bringup_pid" || rc=$?
  bringup_pid=""
  cat "$bringup_log"
  if [ "$rc" != 0 ]; then
    echo "test.sh: bringing up the local Slurm cluster or chromium failed (rc=$rc): output above" >&2
    exit "$rc"
  fi
  eval "$(./scripts/slurm-local.sh env)"
  # the report's browser test (Debian's chromium, headless)
  LAUNCHER_CHROMIUM="$(cat "$bringup_log.chromium")"
  export LAUNCHER_CHROMIUM LAUNCHER_REQUIRE_BROWSER=1 LAUNCHER_REQUIRE_SLURM=1
}

./scripts/setup.sh

if [ "${1:-}" = "--fast" ]; then
  shift
  # a path is an argument that is no option and no option's value, and names a file or directory
  # (tests/unit/test_x.py::test_y included); without one, tests/unit is what runs
  path=0 value=0
  for a in "$@"; do
    if [ "$value" = 1 ]; then value=0; continue; fi
    case "$a" in
      -k|-m|-p|-o|-c|-n|-W|-r|--tb|--deselect|--ignore|--ignore-glob|--junitxml|--junit-xml|--junit-prefix|\
      --rootdir|--basetemp|--confcutdir|--durations|--durations-min|--maxfail|--dist|--timeout|--log-file|\
      --log-level|--log-cli-level|--override-ini|--pythonwarnings|--numprocesses|--maxprocesses|--import-mode|\
      --capture|--color|--cov|--cov-report) value=1 ;;
      -*) ;;
      *) if [ -e "${a%%::*}" ]; then path=1; fi ;;
    esac
  done
  [ "$path" = 1 ] || set -- "$@" tests/unit
  exec .venv/bin/python -m pytest -q -ra "$@"
fi

if [ $# -gt 0 ]; then
  await_bringup
  rm -f "$bringup_log.started"  # a chosen set of tests leaves the cluster up for the next one
  status=0
  .venv/bin/python -m pytest -q -ra --durations=25 "$@" || status=$?
  exit "$status"
fi

# DeepSpeed's CPU Adam op (zero.offload_optimizer) compiles on first use, ~2 min on 2 cores, cached in
# ~/.cache/torch_extensions: built beside the pure tier (one core each) instead of inside a drill.
.venv/bin/python -c 'from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()' \
  >/tmp/launcher-cpu-adam-build.log 2>&1 &
build_pid=$!
status=0
unit_report=() integration_report=()
if [ -n "${LAUNCHER_TEST_REPORTS:-}" ]; then
  mkdir -p "$LAUNCHER_TEST_REPORTS"
  unit_report=(-o junit_family=xunit1 "--junitxml=$LAUNCHER_TEST_REPORTS/unit.xml")
  integration_report=(-o junit_family=xunit1 "--junitxml=$LAUNCHER_TEST_REPORTS/integration.xml")
fi
.venv/bin/python -m pytest -q -ra --durations=10 -n 2 ${unit_report[@]+"${unit_report[@]}"} tests/unit || status=$?
wait "$build_pid" || echo "test.sh: the CPU Adam build failed here (the drill builds it again): $(tail -3 /tmp/launcher-cpu-adam-build.log)"
build_pid=""
await_bringup
# three workers on two cores (the Slurm drills wait on the scheduler while the local ones compute; --dist
# loadgroup: tests/conftest.py puts the Slurm tests in two groups, each module's in one): docs/testing.md
.venv/bin/python -m pytest -q -ra --durations=25 -n "${LAUNCHER_TEST_WORKERS:-3}" --dist loadgroup \
  ${integration_report[@]+"${integration_report[@]}"} tests/integration || status=$?
exit "$status"
