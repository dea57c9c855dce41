"""Shared fixtures: the real SmolLM2 model, loaded once per test session."""

from __future__ import annotations

import os
from pathlib import Path

# Triton's interpreter runs exact mode's Triton kernel on CPU (tests/server/test_exact.py). It
# has to be on before anything imports triton (torchao does, through transformers).
if os.environ.get("KVSERVE_TEST_DEVICE", "cpu") == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Under pytest-xdist (the README's test command) each worker, and every server it starts,
# computes on its share of the cores: two workers of two threads each on CI's two cores
# would spin against each other (OpenMP teams busy-wait).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    os.environ["OMP_NUM_THREADS"] = str(max(1, cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import pytest  # noqa: E402
import torch

from server.model_loader import LoadedModel, load_model
from server.settings import default_cache_dir
from tests.device import DEVICE, DTYPE_NAME

torch.set_grad_enabled(False)
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def test_cache_dir() -> Path:
    """Converted models are kept between runs (the first conversion takes ~25 s)."""
    return Path(os.environ.get("KVSERVE_TEST_CACHE_DIR", default_cache_dir()))


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model(None, cache_dir=test_cache_dir(), device=str(DEVICE), dtype=DTYPE_NAME)


@pytest.fixture(scope="session")
def tokenizer(smollm2: LoadedModel):
    return smollm2.tokenizer


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def app_client(smollm2):
    """`async with app_client(**settings) as client`: an in-process app on the shared model
    (Settings on the test device, which a draft model loads onto), its responses checked for
    conformance (tests/inprocess.py)."""
    import contextlib

    from tests.inprocess import served

    @contextlib.asynccontextmanager
    async def make(**overrides):
        async with served(smollm2, **overrides) as s:
            yield s.http

    return make
