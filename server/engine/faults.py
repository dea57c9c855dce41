"""Faults injected on purpose: the test-only switch that tests and bench/soak.py use to prove
that a failing row fails alone, that an out-of-memory step shrinks, and that a model that
cannot run is never reported ready.

Off unless the server process starts with `KVSERVE_TEST_FAULTS` set to a comma list of:

* `requests`: a request's `X-Kvserve-Test-Fault` header picks a fault for its rows (`KINDS`):
  `forward` raises in every forward pass that holds the row, `sample` raises when the row's
  token is chosen, `oom` raises torch.OutOfMemoryError in a forward pass that holds the row
  and computes more than `OOM_TOKENS` tokens;
* `model`: every forward pass raises (a model that cannot run);
* `capture`: CUDA graph capture is attempted and fails (off a GPU it is attempted for real);
* `rank`: a tensor-parallel follower fails to start once its shard is loaded (server/startup.py
  `follow`), with the status of a model that cannot run.

Never on in production: the header is ignored (and not even read) while the switch is off.
"""

from __future__ import annotations

import os

import torch

ENV = "KVSERVE_TEST_FAULTS"
HEADER = "x-kvserve-test-fault"
KINDS = ("forward", "sample", "oom")
OOM_TOKENS = 32


class InjectedFault(RuntimeError):
    """A fault raised on purpose (`KVSERVE_TEST_FAULTS`)."""


def switched_on(mode: str) -> bool:
    """Whether `mode` (requests, model, capture) is on in this process."""
    return mode in {m.strip() for m in os.environ.get(ENV, "").split(",")}


def request_fault(headers) -> str | None:
    """The fault a request asks for by header, when the switch allows it (else None)."""
    if not switched_on("requests"):
        return None
    kind = headers.get(HEADER)
    return kind if kind in KINDS else None


class Faults:
    """The engine's injection points; `from_env` gives None when the switch is off, so the
    engine pays one `is None` test a step."""

    def __init__(self, model: bool) -> None:
        self.model = model

    @classmethod
    def from_env(cls) -> Faults | None:
        if not switched_on("requests") and not switched_on("model"):
            return None
        return cls(switched_on("model"))

    def install(self, model) -> list:
        """With `model` on: every forward pass of `model` raises (the start-up check's too).
        Returns the hooks, for the engine to remove when it stops (tests share one model)."""
        return [model.register_forward_pre_hook(_broken)] if self.model else []

    def before_forward(self, plan) -> None:
        """Raise what the plan's rows asked for, before the forward pass computes them."""
        for row in plan.rows:
            fault = row.seq.request.fault
            if fault == "forward":
                raise InjectedFault(f"injected: forward pass of {row.seq.request_id}")
            if fault == "oom" and plan.num_tokens > OOM_TOKENS:
                raise torch.OutOfMemoryError(f"injected: {plan.num_tokens} tokens with {row.seq.request_id}")

    def before_sampling(self, seqs) -> None:
        for seq in seqs:
            if seq.request.fault == "sample":
                raise InjectedFault(f"injected: sampling of {seq.request_id}")


def _broken(module, args) -> None:
    raise InjectedFault("injected: the model cannot run")
