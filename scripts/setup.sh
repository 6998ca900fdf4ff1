#!/usr/bin/env bash
# Sets up a fresh machine: system packages (when root), a virtual environment in .venv, the project and its
# test tools. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

# coturn, haproxy and nftables: the TURN, replica and network-fault tests (tests/netns_support.py)
apt_packages=(espeak-ng sox chromium coturn haproxy nftables)
missing=()
for p in "${apt_packages[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
command -v npm >/dev/null 2>&1 || missing+=(nodejs npm)  # the Realtime agents SDK's browser test
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ]; then
        echo "setup: installing system packages: ${missing[*]}"
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
    else
        echo "setup: not root, skipping system packages: ${missing[*]} (the speech and browser tests need them)" >&2
    fi
fi

python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# The CPU build of torch lies on this machine's disk; installing it first keeps pip from fetching a CUDA build.
.venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==${TORCH_VERSION:-2.13.0}"
# The dependencies include pipecat-ai, whose wheel carries the Smart Turn end-of-turn model (README: Turn-taking)
"${pip[@]}" -e ".[test]"
# The official Realtime agents SDK (npm), for tests/browser/test_realtime_sdk.py: installed as a user would,
# from the committed package-lock.json.
sdk=tests/browser/realtime_sdk
if command -v npm >/dev/null 2>&1 && ! [ "$sdk/node_modules/.package-lock.json" -nt "$sdk/package-lock.json" ]; then
    (cd "$sdk" && npm ci --no-audit --no-fund --loglevel=error)
fi
echo "setup: done (.venv/bin/rtc-agent)"
