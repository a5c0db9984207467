#!/usr/bin/env bash
# Fresh machine -> set up, then run the main job on the embedded default (cluster=local):
# a small GPT trained by 2 local processes (gloo on CPU). Extra args are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/launch "$@"
