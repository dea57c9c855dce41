"""A compiled forward: the model's forward for the paged path's decode steps (decode rows alone,
padded to a bucket) through `torch.compile` (inductor), compiled at warm-up and, on CUDA,
captured inside the model runner's own graphs; and on the paged path, the same forward for the
steps of more than decode rows, without a graph.

What makes one graph of the whole forward possible:
* The step reaches the layer patches through its context (server/engine/context.py), which
  dynamo reads like any attribute; nothing is passed through a keyword the modeling code drops.
* Each layer's attention (the store and the paged read) is one opaque op,
  `torch.ops.kvserve.decode_attention` (server/engine/attention.py): dynamo never specialises
  on a layer's pool tensor, and the store mutates the pool in place rather than through a
  functional copy of it. On CPU the linear layers packed for oneDNN run through the opaque
  `kvserve::packed_linear` (inductor lowers oneDNN's op only for weights it packed itself).
* Dynamic in the rows and the context bucket (`dynamic=True`), so one graph serves every
  bucket: a compilation for one row (dynamo specialises sizes of 1) and one for the others,
  never one per layer or per bucket. `fullgraph=True`: a graph break is an error, which the
  warm-up turns into a named fallback (or exit 8 under `--compile require`).

Features whose patches keep per-step Python state the compiled graph would freeze (LoRA
slots, a hybrid's deferred state writes, LongRoPE's switch, exact mode's own kernels, a probe's
observer) keep the eager forward, named by `why_eager`.

Steps of more than decode rows (a prefill chunk beside decode rows, tokens a grammar forced,
drafted tokens to verify) have shapes that vary with every step, and batches of several kinds
and widths (server/engine/attention.py). On the paged path they run the compiled forward too,
with the step's context marked `opaque`: each layer then attends every batch in one opaque op
(`torch.ops.kvserve.step_attention`) that reads them from the context, so the graph holds no
batch, and one compilation (three in all) serves every mix. There the step's tokens and kept
logits are never one or none (`ModelRunner._step` pads what is kept), so dynamo does not
specialise on them. The row path (CPU's default) keeps its eager prefill.

Inductor's cache lives under kvserve's cache dir (`use_cache_dir`), so a restart loads the
compiled kernels instead of compiling again.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
import torch.fx.experimental._config

from server.engine.cpu_linear import dense


def decode_forward(model) -> Callable[..., object]:
    """`model` compiled for decode steps (lazily: the first call compiles)."""
    forward = torch.compile(model, fullgraph=True, dynamic=True)

    def call(**inputs):
        # NOTE: without duck sizing: with it, dynamo equates sizes that happen to be equal when
        # it compiles (a pool's 2 KV heads and a 2-row bucket's storage offset) and recompiles
        # at the first step where they differ
        with torch.fx.experimental._config.patch(use_duck_shape=False):
            return forward(**inputs)

    return call


def why_eager(runner) -> str | None:
    """Why `runner`'s decode steps keep the eager forward (None: they can compile)."""
    if runner.exact:
        return "exact mode runs its own batch-invariant kernels"
    if runner.adapters is not None:
        return "LoRA adapters pick each row's slot per step"
    if runner.pool.states is not None:
        return "a hybrid's recurrent layers store their states after the step"
    if runner.rope is not None:
        return "LongRoPE switches factors by each row's length"
    if runner.observe is not None:
        return "an observed forward (the families probe)"
    quantized = sum(isinstance(m, torch.nn.Linear) and not dense(m) for m in runner.model.modules())
    if quantized:
        return f"{quantized} quantized linear layers run their own kernels"
    return None


def compilations() -> int:
    """Graphs dynamo has compiled in this process so far (a recompilation counts again)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    """Graph breaks dynamo has met in this process so far."""
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def use_cache_dir(cache_dir: Path) -> None:
    """Keep inductor's (and Triton's) compiled kernels under `cache_dir`/compile, unless the
    environment names other places."""
    path = Path(cache_dir) / "compile"
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(path / "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", str(path / "triton"))
