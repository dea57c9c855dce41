"""Shared fixtures: the real SmolLM2 model, loaded once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from server.model_loader import LoadedModel, load_model
from server.settings import default_cache_dir

torch.set_grad_enabled(False)


def test_cache_dir() -> Path:
    """Converted models are kept between runs (the first conversion takes ~25 s)."""
    return Path(os.environ.get("KVSERVE_TEST_CACHE_DIR", default_cache_dir()))


@pytest.fixture(scope="session")
def smollm2() -> LoadedModel:
    return load_model(None, cache_dir=test_cache_dir(), device="cpu", dtype="float32")


@pytest.fixture(scope="session")
def tokenizer(smollm2: LoadedModel):
    return smollm2.tokenizer
