"""The Docker images built and run for real: scripts/image-test.sh under podman.

The full run needs root, podman, runc, curl and debootstrap (Debian's packages; no Docker daemon,
no registry) and takes about 10 minutes with its cached bases; where any is missing (CI) it
skips with the reason. KVSERVE_IMAGE_TEST=0 skips it too. The script's failure path is checked
everywhere: without podman it must stop at once with a non-zero status and say what is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts/image-test.sh"
STEPS = [
    "prerequisites", "debian-base", "torch-index",
    "build-cpu", "ready-cpu", "chat-cpu", "structured-cpu", "drain-cpu",
    "torch-base", "build-gpu", "ready-gpu-image-on-cpu",
]


def why_not_runnable() -> str | None:
    if os.environ.get("KVSERVE_IMAGE_TEST") == "0":
        return "KVSERVE_IMAGE_TEST=0"
    missing = [tool for tool in ("podman", "runc", "curl", "debootstrap") if not shutil.which(tool)]
    if missing:
        return f"{', '.join(missing)} not installed (apt-get install podman buildah debootstrap runc)"
    if os.geteuid() != 0:
        return "scripts/image-test.sh runs as root (debootstrap, podman's root storage)"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_script_stops_when_podman_is_missing(tmp_path: Path) -> None:
    # A PATH with the script's basic tools but no podman.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "id", "date", "grep", "cut", "head", "mkdir", "curl"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    (bin_dir / "python3").symlink_to(sys.executable)
    result = subprocess.run(
        [str(bin_dir / "bash"), str(SCRIPT)], capture_output=True, text=True, timeout=60,
        env={"PATH": str(bin_dir), "IMAGE_TEST_CACHE": str(tmp_path / "cache")},
    )
    assert result.returncode != 0
    assert re.search(r"^FAIL prerequisites: missing podman", result.stderr, re.M), result.stderr
    assert "image-test: FAILED" in result.stderr
    assert "image-test: all checks passed" not in result.stdout


@pytest.mark.e2e
def test_images_build_and_serve() -> None:
    reason = why_not_runnable()
    if reason:
        pytest.skip(reason)
    result = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=3600,
        env={**os.environ, "IMAGE_TEST_PORT": str(free_port())},
    )
    tail = (result.stdout + result.stderr)[-6000:]
    assert result.returncode == 0, tail
    assert not re.search(r"^FAIL ", result.stdout + result.stderr, re.M), tail
    for step in STEPS:
        assert re.search(rf"^PASS {step} \(\d+ s\)", result.stdout, re.M), f"no PASS for {step}\n{tail}"
    assert re.search(r"^PASS ready-cpu .*/ready 200 after [\d.]+ s, HEALTHCHECK passes", result.stdout, re.M)
    assert re.search(r"^content: \{", result.stdout, re.M), "structured output printed no content"
    drain = re.search(r"^PASS drain-cpu .*: (\d+) chunks before SIGTERM, (\d+) at \[DONE\].*exit 0", result.stdout, re.M)
    assert drain and int(drain.group(2)) > int(drain.group(1)), tail
    assert re.search(r"^PASS build-gpu .*kvserve prepare included", result.stdout, re.M)
    assert result.stdout.rstrip().endswith("image-test: all checks passed"), tail
