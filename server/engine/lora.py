"""LoRA adapters on the served model: PEFT's format, many resident at once, applied per row.

An adapter (`read`) is a PEFT directory, `adapter_config.json` and `adapter_model.safetensors`,
read directly: per targeted `nn.Linear` of the base model its `lora_A` [r, in] and `lora_B`
[out, r], and the scaling `lora_alpha / r` (`/ sqrt(r)` with rsLoRA). What kvserve does not
model (DoRA, biases, `modules_to_save`, per-module alphas, embeddings, Conv1D layers) and every
mismatch with the base (a module it lacks, other shapes, a rank above `--max-lora-rank`, a
corrupt file) is refused with `AdapterError`, whose `reason` names it.

`Adapters` holds the resident ones (slot 1..max_loras; slot 0 is the base) and wraps each
targeted linear layer: per layer, the resident adapters' `lora_A` stacked into `A` [C, in] and
their `lora_B`, scaled, into `B` [out, C], C the sum of their ranks, and each column's slot.
A step gives every token its row's slot (`running`); the layer then adds

    ((x @ A.T) * mask) @ B.T,   mask[t, c] = 1 where column c belongs to token t's adapter

to its own output: every row of a step gets its own adapter's delta (the base's rows none)
in the same two products whatever mix of adapters the step holds, so a row's result does not
depend on which others run beside it, and the shapes stay fixed for CUDA graphs (the slots sit
in the model runner's persistent buffer). The cost grows with the resident ranks' sum.

Sessions: a session's KV depends on the adapter that computed it, so requests on an adapter are
keyed by `session_principal` (the principal, the adapter's name and the hash of its weights):
reuse, anonymous prefixes, tiers and restarts never meet another adapter's KV.
"""

from __future__ import annotations

import hashlib
import json
import math
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from server.engine import exact as exact_mode

_current = threading.local()
_PREFIX = "base_model.model."


class AdapterError(ValueError):
    """An adapter kvserve cannot serve: `reason` a short slug, the message says why."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    rank: int  # the largest of its modules' ranks
    scaling: float
    key: str  # 12 hex digits of its weights' sha256: what its sessions are keyed by
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False, compare=False, default_factory=dict)  # module -> (A, B)


def session_principal(principal: str, adapter: Adapter | None) -> str:
    """The principal a request's sessions are keyed by: the base model's requests keep theirs,
    an adapter's get its name and weights' hash added (another adapter, or this name loaded
    with other weights after a restart, never reuses them)."""
    return principal if adapter is None else f"{principal}|lora:{adapter.name}:{adapter.key}"


def read(path: str | Path, model, *, name: str, max_rank: int) -> Adapter:
    """The PEFT LoRA adapter in directory `path`, checked against `model`; AdapterError."""
    directory = Path(path)
    config_file, weights_file = directory / "adapter_config.json", directory / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterError("not-found", f"adapter '{name}': {directory} has no adapter_config.json and adapter_model.safetensors")
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
        blob = weights_file.read_bytes()
        tensors = load_file(str(weights_file))
    except Exception as exc:  # noqa: BLE001 - whatever is wrong with the files, it is the adapter's
        raise AdapterError("corrupt", f"adapter '{name}': its files cannot be read ({type(exc).__name__}: {exc})") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterError("not-lora", f"adapter '{name}': not a LoRA adapter (peft_type {config.get('peft_type') if isinstance(config, dict) else None!r})")
    for key, ok, what in (("use_dora", lambda v: not v, "DoRA"), ("bias", lambda v: v in (None, "none"), "trained biases"),
                          ("modules_to_save", lambda v: not v, "fully trained modules (modules_to_save)"),
                          ("alpha_pattern", lambda v: not v, "per-module alphas"), ("fan_in_fan_out", lambda v: not v, "Conv1D layers")):
        if not ok(config.get(key)):
            raise AdapterError("unsupported", f"adapter '{name}': {what} are not served")
    alpha, rslora = float(config.get("lora_alpha", 8)), bool(config.get("use_rslora", False))
    modules = dict(model.named_modules())
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem, _, kind = key.removeprefix(_PREFIX).rpartition(".")
        module_name, _, part = stem.rpartition(".")
        if kind != "weight" or part not in ("lora_A", "lora_B"):
            raise AdapterError("unsupported", f"adapter '{name}': tensor {key} is not a LoRA A or B matrix of a linear layer")
        pairs.setdefault(module_name, {})[part] = tensor
    if not pairs:
        raise AdapterError("corrupt", f"adapter '{name}': its weights hold no LoRA matrices")
    weights, rank = {}, 0
    for module_name, pair in sorted(pairs.items()):
        module = modules.get(module_name)
        if not isinstance(module, torch.nn.Linear):
            raise AdapterError("targets", f"adapter '{name}': the base model has no linear layer {module_name}")
        if set(pair) != {"lora_A", "lora_B"}:
            raise AdapterError("corrupt", f"adapter '{name}': {module_name} lacks its {'lora_B' if 'lora_A' in pair else 'lora_A'}")
        a, b = pair["lora_A"], pair["lora_B"]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != module.in_features or b.shape != (module.out_features, r):
            raise AdapterError("shapes", f"adapter '{name}': {module_name} is {module.in_features} -> {module.out_features} in the "
                               f"base model, its A {tuple(a.shape)} and B {tuple(b.shape)} do not fit (an adapter of another base?)")
        if r > max_rank:
            raise AdapterError("rank", f"adapter '{name}': rank {r} of {module_name} is above --max-lora-rank {max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError("corrupt", f"adapter '{name}': {module_name} holds values that are not finite")
        scaling = alpha / (math.sqrt(r) if rslora else r)
        weights[module_name] = (a.float(), b.float() * scaling)
        rank = max(rank, r)
    return Adapter(name, str(directory), rank, alpha / (math.sqrt(rank) if rslora else rank),
                   hashlib.sha256(blob).hexdigest()[:12], weights)


class Adapters:
    """The resident adapters of one model, and its linear layers wrapped to apply them (the
    module docstring). Engine thread, except `get`/`names` (reads)."""

    def __init__(self, model, *, max_loras: int, max_rank: int) -> None:
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self._slots: dict[str, tuple[int, Adapter]] = {}
        # per targeted layer: the resident adapters' A [C, in], scaled B [out, C] and each
        # column's slot, on the model's device from `add` on (the KV budget, measured after
        # the adapters are added, counts them)
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._layers: dict[str, _Layer] = {}
        self._lock = threading.Lock()
        self._attached = False

    @property
    def nbytes(self) -> int:
        """Device bytes of the stacked matrices."""
        return sum(t.numel() * t.element_size() for stack in self._stacks.values() for t in stack[:2])

    def attach(self) -> None:
        """Wrap the targeted layers (the model runner calls it once it has packed the CPU
        weights, so the wrappers run the packed products)."""
        with self._lock:
            self._attached = True
            self._apply()

    @property
    def names(self) -> list[str]:
        return list(self._slots)

    def get(self, name: str) -> tuple[int, Adapter] | None:
        return self._slots.get(name)

    def add(self, adapter: Adapter) -> int:
        """Make `adapter` resident; its slot. AdapterError when its name is taken or every
        slot is."""
        with self._lock:
            if adapter.name in self._slots:
                raise AdapterError("name-clash", f"an adapter named '{adapter.name}' is loaded already")
            used = {slot for slot, _ in self._slots.values()}
            free = [s for s in range(1, self.max_loras + 1) if s not in used]
            if not free:
                raise AdapterError("too-many", f"{self.max_loras} adapters are loaded already (--max-loras)")
            self._slots[adapter.name] = (free[0], adapter)
            self._rebuild()
            return free[0]

    def remove(self, name: str) -> Adapter:
        with self._lock:
            _, adapter = self._slots.pop(name)
            self._rebuild()
            return adapter

    def _rebuild(self) -> None:
        """Each targeted layer's stacked matrices from the resident adapters (in slot order)."""
        modules = dict(self.model.named_modules())
        self._stacks = {}
        for module_name in sorted({m for _, a in self._slots.values() for m in a.weights}):
            weight = modules[module_name].weight
            parts = [(slot, a.weights[module_name]) for slot, a in sorted(self._slots.values(), key=lambda s: s[0]) if module_name in a.weights]
            self._stacks[module_name] = (
                torch.cat([a for _, (a, _) in parts]).to(weight.device, weight.dtype),
                torch.cat([b for _, (_, b) in parts], dim=1).to(weight.device, weight.dtype),
                torch.tensor([slot for slot, (a, _) in parts for _ in range(a.shape[0])], device=weight.device),
            )
        self._apply()

    def _apply(self) -> None:
        """Point the wrapped layers at the stacks (once attached)."""
        if not self._attached:
            return
        modules = dict(self.model.named_modules())
        for module_name, stack in self._stacks.items():
            if module_name not in self._layers:
                self._layers[module_name] = _Layer(modules[module_name])
            self._layers[module_name].set(*stack)
        for module_name, layer in self._layers.items():
            if module_name not in self._stacks:
                layer.clear()


class _Layer:
    """One linear layer with the resident adapters' deltas added during a step."""

    def __init__(self, module: torch.nn.Linear) -> None:
        self.a = self.b = self.columns = None
        original = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            y = original(x)
            slots = getattr(_current, "slots", None)
            if slots is None or self.a is None:
                return y
            mask = _mask(slots, self.columns, x.dtype)
            return y + _product(_product(x, self.a) * mask, self.b)

        module.forward = forward

    def set(self, a: torch.Tensor, b: torch.Tensor, columns: torch.Tensor) -> None:
        self.a, self.b, self.columns = a, b, columns

    def clear(self) -> None:
        self.a = self.b = self.columns = None


def _product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T; in exact mode one call per whole tile of rows, as exact mode's own linear
    layers (server/engine/exact.py), so a row's delta never depends on the rows beside it."""
    if not exact_mode.active():
        return F.linear(x, weight)
    tile = exact_mode.ROW_TILE if x.device.type == "cpu" else exact_mode.CUDA_ROW_TILE
    return exact_mode.by_tiles(lambda rows: F.linear(rows, weight), x, tile, one_call=False)


def _mask(slots: torch.Tensor, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, C]: 1 where column c belongs to token t's adapter (made once per step and layout)."""
    cache = _current.masks
    key = (id(columns), dtype)
    if key not in cache:
        cache[key] = (slots[:, None] == columns[None, :]).to(dtype)
    return cache[key]


class running:
    """`with running(slots):` this thread's forward passes give token t the adapter of slot
    `slots[t]` ([N] on the device; 0: the base). None (or all the base's): no adapter."""

    def __init__(self, slots: torch.Tensor | None) -> None:
        self.slots = slots

    def __enter__(self) -> None:
        self._before = getattr(_current, "slots", None), getattr(_current, "masks", None)
        _current.slots, _current.masks = self.slots, {}

    def __exit__(self, *exc) -> None:
        _current.slots, _current.masks = self._before
