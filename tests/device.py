"""Where the suite runs its models and the tensors it builds: CPU in float32 unless
KVSERVE_TEST_DEVICE (`cpu`, `cuda`) or KVSERVE_TEST_DTYPE (`float32`, `bfloat16`, `float16`)
say otherwise. The assertions are written for float32; other dtypes are for looking, not CI.

NOTE: read once at import; the model fixtures, every tiny model and every tensor a test builds,
the in-process apps' Settings and the `kvserve serve` processes all take it from here, so one
switch moves the whole suite."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = torch.device(os.environ.get("KVSERVE_TEST_DEVICE", "cpu"))
DTYPE_NAME = os.environ.get("KVSERVE_TEST_DTYPE", "float32")
DTYPE: torch.dtype = getattr(torch, DTYPE_NAME)

# The same choice as Settings fields and as `kvserve serve` flags (never `auto`, which would
# pick CUDA and bfloat16 on a GPU box whatever the switch says).
SETTINGS = {"device": DEVICE.type, "dtype": DTYPE_NAME}
SERVE_FLAGS = ("--device", DEVICE.type, "--dtype", DTYPE_NAME)

# GPU-only tests (graph replay against eager, say) skip where no GPU is; CPU-only ones elsewhere.
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
cpu_only = pytest.mark.skipif(DEVICE.type != "cpu", reason=f"a CPU-only code path (KVSERVE_TEST_DEVICE={DEVICE})")
