"""The exit statuses of `kvserve serve`: errors no request can fix end the process with one
clear line (what is wrong, what to change) and a status an orchestrator or a deployment's CI
can act on, as vLLM and TGI do. The manual's table (docs/reference/exit-status.md) is generated
from `STATUSES` by scripts/docs_reference.py."""

from __future__ import annotations

OK = 0
FAILED = 1  # `serve --check` failed, or an unexpected start-up error (the log has its traceback)
SETTINGS = 2  # invalid settings: a flag or KVSERVE_* variable
BIND = 3  # uvicorn could not start: the port is taken or the address unknown
MODEL_SOURCE = 4  # the model cannot be found or loaded
UNSUPPORTED = 5  # the model's family or layers are refused by name, or transformers does not know it
KV_BUDGET = 6  # the KV budget does not hold one sequence at the context
MODEL_CANNOT_RUN = 7  # the start-up forward pass (prefill and decode) failed
REQUIRED_PATH = 8  # a path asked for as required is unavailable (--cuda-graphs=require, --compile=require)
ENGINE_DEAD = 9  # the model stopped running while serving (a known-good forward pass fails)

STATUSES = {
    OK: "clean exit: drained after SIGTERM, or `serve --check` passed",
    FAILED: "`serve --check` failed, or an unexpected start-up error (the log has the traceback)",
    SETTINGS: "invalid settings (a flag or KVSERVE_* variable)",
    BIND: "the HTTP server could not start (port taken, unknown address)",
    MODEL_SOURCE: "the model cannot be found or loaded (path, hub id, files, quantization)",
    UNSUPPORTED: "the model's family or layers are not supported (refused by name), or transformers does not know its architecture",
    KV_BUDGET: "the KV budget does not hold one sequence at the context (the line says what to lower)",
    MODEL_CANNOT_RUN: "the model failed its start-up forward pass (prefill and decode) or a warm-up request",
    REQUIRED_PATH: "a required fast path is unavailable (--cuda-graphs=require without graphs, --compile=require uncompiled)",
    ENGINE_DEAD: "the engine died while serving: the model stopped running",
}


class StartupError(Exception):
    """A start-up error no request can fix: `status` is the process's exit status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def status_of(exc: BaseException) -> int:
    """The exit status a start-up exception ends the process with."""
    # NOTE: imported here, not above: the CLI imports this module to parse its flags and print
    # --help, which must not wait for torch and transformers.
    from server.engine.core import StartupCheckFailed
    from server.engine.unsupported import UnsupportedModel
    from server.kv_budget import KVBudgetError
    from server.model_loader import ModelSourceError, UnknownArchitecture

    if isinstance(exc, StartupError):
        return exc.status
    for kind, status in (
        (ModelSourceError, MODEL_SOURCE),
        (UnsupportedModel, UNSUPPORTED),
        (UnknownArchitecture, UNSUPPORTED),
        (KVBudgetError, KV_BUDGET),
        (StartupCheckFailed, MODEL_CANNOT_RUN),
    ):
        if isinstance(exc, kind):
            return status
    return FAILED
