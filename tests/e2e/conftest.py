"""Real `kvserve serve` processes (uvicorn), driven by the official openai SDK and httpx."""

from __future__ import annotations

import pytest

from bench.common import launch
from tests.conftest import test_cache_dir
from tests.device import SERVE_FLAGS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """An open server with default settings."""
    with launch(tmp_path_factory.mktemp("server"), "--cache-dir", str(test_cache_dir()), *SERVE_FLAGS) as s:
        yield s


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory):
    """API keys on, one running sequence, one waiting slot and a short deadline."""
    with launch(
        tmp_path_factory.mktemp("server"),
        "--cache-dir", str(test_cache_dir()), *SERVE_FLAGS,
        "--api-key", "key-a", "--max-running", "1", "--max-queue", "1", "--request-timeout-s", "4",
        env={"KVSERVE_MODEL_ALIASES": "smol,gpt-local"},
    ) as s:
        yield s
