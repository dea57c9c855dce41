"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: LoRA adapters loaded and unloaded at
run time, with vLLM's names, bodies and plain-text answers. Served only with
--enable-lora-loading (otherwise these paths are 404s like any unknown one), behind the API key
like every /v1 route, and only for adapters under --lora-dir.

A load reads and checks the adapter off the event loop (`lora.Adapters.load`, the loader --lora
uses at start-up) and adds it to the host-memory set; a request naming it gets it swapped into a device slot then. Every
refusal names its reason and leaves the served adapters and their sessions as they were: 400
for an adapter that cannot be served here (its files, its base, its rank, its layers, its
name, a path outside --lora-dir), 409 for a name already served, 507 when no more adapters fit
(--max-cpu-loras) or the host lacks the memory for this one. An unload ends the adapter's
waiting and running requests and drops its sessions from every tier (Engine.unload_adapter).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from server.api.errors import APIError
from server.engine import lora
from server.settings import adapter_name_problem

log = logging.getLogger(__name__)
router = APIRouter()

HOST_MEMORY_MARGIN = 2**30  # host memory a load leaves free besides the adapter's own
STATUS = {"name-clash": 409, "too-many": 507, "no-memory": 507}  # every other refusal is a 400


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; names identify adapters here


def _refuse(metrics, action: str, reason: str, message: str, status: int | None = None) -> APIError:
    metrics.lora_loads.labels(action, reason).inc()
    return APIError(status or STATUS.get(reason, 400), message, code=f"lora_{reason.replace('-', '_')}", param="lora_name" if reason in ("name", "name-clash", "unknown") else None)


def resolve_path(lora_dir: Path, lora_path: str) -> Path | None:
    """`lora_path` (absolute, or relative to `lora_dir`) with links resolved, when it lies under
    `lora_dir`; None when it does not."""
    root = lora_dir.resolve()
    try:
        path = (root / lora_path).resolve()  # an absolute lora_path replaces root
    except (OSError, ValueError):  # a NUL byte, a name too long, a link loop
        return None
    return path if path.is_relative_to(root) else None


def available_host_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes; None where it is not known."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = request.app.state.kv
    ctx, settings, metrics = state.require_ctx(), state.settings, state.metrics
    name = body.lora_name
    if problem := adapter_name_problem(name):
        raise _refuse(metrics, "load", "name", problem)
    path = resolve_path(settings.lora_dir, body.lora_path)
    if path is None:
        raise _refuse(metrics, "load", "path", f"lora_path {body.lora_path!r} is not under the server's --lora-dir; adapters load from there only")
    weights = path / "adapter_model.safetensors"
    free = available_host_memory()
    if free is not None and weights.is_file() and weights.stat().st_size + HOST_MEMORY_MARGIN > free:
        raise _refuse(metrics, "load", "no-memory", f"adapter '{name}': its {weights.stat().st_size / 2**20:.0f} MiB do not fit the "
                      f"{free / 2**20:.0f} MiB of host memory available")
    try:
        await asyncio.to_thread(ctx.adapters.load, name, path, served={ctx.model_id, *ctx.model_aliases})
    except lora.AdapterError as exc:
        raise _refuse(metrics, "load", exc.reason, str(exc)) from None
    metrics.lora_loads.labels("load", "ok").inc()
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = request.app.state.kv
    ctx, metrics = state.require_ctx(), state.metrics
    name = body.lora_name
    try:
        _, dropped = await asyncio.wrap_future(ctx.engine.unload_adapter(name))
    except KeyError:
        raise _refuse(metrics, "unload", "unknown", f"no LoRA adapter named '{name}' is loaded", status=404) from None
    metrics.lora_loads.labels("unload", "ok").inc()
    metrics.forget_adapter(name)
    log.info("LoRA adapter %r unloaded; %d of its sessions dropped", name, dropped)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
