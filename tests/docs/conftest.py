"""The servers documentation snippets run against: one `kvserve serve` per distinct
`<!-- server: FLAGS -->`, started on first use and shared by the whole session."""

from __future__ import annotations

import pytest

from tests.conftest import test_cache_dir
from tests.device import DEVICE, DTYPE_NAME, SERVE_FLAGS
from tests.docs.snippet_runner import ServerPool


@pytest.fixture(scope="session")
def server_pool(tmp_path_factory):
    pool = ServerPool(tmp_path_factory.mktemp("doc-servers"), ("--cache-dir", str(test_cache_dir()), *SERVE_FLAGS))
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def server_env() -> dict[str, str]:
    """What a server a snippet starts itself gets: the suite's model cache and device (its own
    flags still win)."""
    return {"KVSERVE_CACHE_DIR": str(test_cache_dir()), "KVSERVE_DEVICE": DEVICE.type, "KVSERVE_DTYPE": DTYPE_NAME}
