#!/usr/bin/env bash
# Fresh machine -> set up, then run the main job on the embedded default (cluster=local):
# a small GPT trained by local processes: one per GPU of this host (as many as its batch splits
# over), or 2 on CPU (gloo) where it has none. Extra args are Hydra overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/launch "$@"
