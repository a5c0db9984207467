#!/usr/bin/env bash
# browser.sh - make sure Debian's chromium is installed (the report's browser test opens the HTML
# pages in it, headless) and print its path. Installs with apt-get when missing (needs root).
set -euo pipefail
for b in chromium chromium-browser; do
  if command -v "$b" >/dev/null 2>&1; then command -v "$b"; exit 0; fi
done
echo "[browser] installing Debian's chromium (headless report test)" >&2
export DEBIAN_FRONTEND=noninteractive
{ apt-get update -q && apt-get install -y -q --no-install-recommends chromium; } >&2
command -v chromium
