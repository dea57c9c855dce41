"""LoRA adapters on the served model: PEFT's format, many resident at once, applied per row.

An adapter (`read`) is a PEFT directory, `adapter_config.json` and `adapter_model.safetensors`,
read directly: per targeted `nn.Linear` of the base model its `lora_A` [r, in] and `lora_B`
[out, r], and the scaling `lora_alpha / r` (`/ sqrt(r)` with rsLoRA). What kvserve does not
model (DoRA, biases, `modules_to_save`, per-module alphas, embeddings, Conv1D layers) and every
mismatch with the base (a module it lacks, other shapes, a rank above `--max-lora-rank`, a
corrupt file) is refused with `AdapterError`, whose `reason` names it.

`Adapters` holds every loaded adapter in host memory and up to `max_loras` of them resident on
the device, in slots 1..S (slot 0 is the base); it wraps each targeted linear layer: per layer
the slots' `lora_A` stacked into `A` [S*R, in] and their `lora_B`, scaled, into `B` [out, S*R],
R columns per slot, and each column's slot. A step gives every token its row's slot
(`StepContext.adapters`, server/engine/context.py); the layer then adds

    ((x @ A.T) * mask) @ B.T,   mask[t, c] = 1 where column c belongs to token t's slot

to its own output: every row of a step gets its own adapter's delta (the base's rows none)
in the same two products whatever mix of adapters the step holds, so a row's result does not
depend on which others run beside it, and the shapes stay fixed for CUDA graphs (the slots sit
in the model runner's persistent buffer; an adapter swapped into a slot is copied into the same
tensors). The cost grows with S*R. Adapters beyond the slots wait in host memory and are
swapped in, least recently used out, when a request needs one (`Adapters.acquire`). The
layers of one parent that share an input (q/k/v, gate/up) share the first product (`_Group`).

Sessions: a session's KV depends on the adapter that computed it, so requests on an adapter are
keyed by `session_principal` (the principal, the adapter's name and the hash of its weights):
reuse, anonymous prefixes, tiers and restarts never meet another adapter's KV, and unloading an
adapter drops exactly its sessions (`scope`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from cache_manager import kv
from server.engine import context
from server.engine import exact as exact_mode

log = logging.getLogger(__name__)

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
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False, compare=False, default_factory=dict)  # module -> (A, scaled B)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


def session_principal(principal: str, adapter: Adapter | None) -> str:
    """The principal a request's sessions are keyed by: the base model's requests keep theirs,
    an adapter's get its name and weights' hash added (another adapter, or this name loaded
    with other weights after a restart, never reuses them)."""
    return principal if adapter is None else principal + scope(adapter)


def scope(adapter: Adapter) -> str:
    """What every principal of the adapter's sessions ends with (`session_principal`)."""
    return f"|lora:{adapter.name}:{adapter.key}"


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
        if module_name.rpartition(".")[2] == "kv_b_proj" and kv.layout(model.config).latent:
            raise AdapterError("targets", f"adapter '{name}': it targets {module_name}, which the MLA latent's attention "
                               "absorbs (server/engine/mla.py); serve it with --mla-cache heads")
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
        # host copies in the model's dtype (what the device slots hold), B scaled in float32 first
        dtype = _compute_dtype(module, model)
        weights[module_name] = (a.to(dtype), (b.float() * scaling).to(dtype))
        rank = max(rank, r)
    return Adapter(name, str(directory), rank, alpha / (math.sqrt(rank) if rslora else rank),
                   hashlib.sha256(blob).hexdigest()[:12], weights)


class AdapterGone(LookupError):
    """A request's adapter was unloaded before it could run."""


class Adapters:
    """Every loaded adapter, kept in host memory, and the device slots the resident ones run
    from; the model's linear layers wrapped to apply them (the module docstring).

    The device layout is fixed once (`allocate`): S slots of R columns per targeted layer, each
    slot's block holding one adapter's A rows and scaled B columns (zero past its rank and in the
    layers it does not target). With `reserve` (adapters loaded at run time) it is sized for the
    worst case from the start, S = max_loras, R = max_rank over every linear layer of the model
    but its output head, so a load never allocates device memory nor changes a shape the CUDA
    graphs were captured with; otherwise for the start-up adapters (S = min(their count,
    max_loras), R their largest rank, the layers they target). More adapters than slots: the
    rest wait in host memory and `acquire` swaps one in, over the least recently used slot no
    running sequence holds (an in-place copy between steps).

    Threads: `add`, `get`, `names` from any thread (under the lock); `acquire`, `release`,
    `remove` on the engine thread (they touch the device slots)."""

    def __init__(self, model, *, max_loras: int, max_rank: int, max_loaded: int | None = None, reserve: bool = False) -> None:
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.max_loaded = max(max_loaded, max_loras) if max_loaded is not None else 2**31  # None: no limit (the server passes one)
        self.reserve = reserve
        self._loaded: dict[str, Adapter] = {}
        self._lock = threading.Lock()
        self._resident: list[Adapter | None] = []  # slot s is _resident[s - 1]
        self._pins: dict[str, int] = {}  # running sequences per resident adapter
        self._used: dict[str, float] = {}  # when each resident adapter last started or ended a sequence
        self.modules: frozenset[str] | None = None  # the layout's targeted layers and rank, once allocated
        self.rank = 0
        # per targeted layer: A [S*R, in] and scaled B [out, S*R] on the model's device, and
        # the slot of each column (one tensor, shared)
        self._stacks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._columns: torch.Tensor | None = None
        self._groups: dict[str, tuple[_Group, int]] = {}  # each targeted layer's group and its place in it
        self._layers: dict[str, _Layer] = {}
        self.swaps = 0  # adapters copied into a slot after the start

    # -- any thread ----------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._loaded)

    def get(self, name: str) -> Adapter | None:
        return self._loaded.get(name)

    @property
    def slots(self) -> list[str | None]:
        """The adapter resident in each device slot (None: free), slot 1 first."""
        with self._lock:
            return [a.name if a is not None else None for a in self._resident]

    @property
    def nbytes(self) -> int:
        """Device bytes of the slots' matrices."""
        return sum(t.numel() * t.element_size() for stack in self._stacks.values() for t in stack)  # A: views, each counted once

    @property
    def host_bytes(self) -> int:
        """Host bytes of every loaded adapter's matrices."""
        with self._lock:
            return sum(a.nbytes for a in self._loaded.values())

    def _check_name(self, name: str, served: Collection[str]) -> None:
        """AdapterError "name-clash" when `name` is one of `served` (the base model's ids) or a
        loaded adapter's. Under the lock."""
        if name in served or name in self._loaded:
            raise AdapterError("name-clash", f"the name '{name}' is already served (the base model, an alias or a "
                               "loaded adapter); unload it first or pick another")

    def add(self, adapter: Adapter, served: Collection[str] = ()) -> None:
        """Load `adapter` (host memory; the device slots take it when a request needs it).
        AdapterError when its name is taken ("name-clash", `_check_name`), `max_loaded` are
        loaded ("too-many") or it does not fit the device layout ("targets", "rank")."""
        with self._lock:
            self._check_name(adapter.name, served)
            if len(self._loaded) >= self.max_loaded:
                raise AdapterError("too-many", f"{len(self._loaded)} adapters are loaded, the most this server holds (--max-cpu-loras)")
            if self.modules is not None:
                outside = sorted(set(adapter.weights) - self.modules)
                if outside:
                    raise AdapterError("targets", f"adapter '{adapter.name}': adapters cannot target {outside[0]} here "
                                       f"(the layers they may target: every linear layer but the output head)")
                if adapter.rank > self.rank:
                    raise AdapterError("rank", f"adapter '{adapter.name}': rank {adapter.rank} is above the {self.rank} the "
                                       "start-up adapters fixed (--max-lora-rank with --enable-lora-loading)")
            self._loaded[adapter.name] = adapter

    def load(self, name: str, path: str | Path, served: Collection[str] = ()) -> Adapter:
        """Read the adapter at `path`, check it against the base model and add it as `name`: the
        one loader, for --lora at start-up and POST /v1/load_lora_adapter at run time (any
        thread; it reads files, so off the event loop). The name is checked before the files
        are read, and again as `add` takes it (another load may have taken it meanwhile);
        otherwise `read`'s and `add`'s refusals."""
        with self._lock:
            self._check_name(name, served)
        adapter = read(path, self.model, name=name, max_rank=self.max_rank)
        self.add(adapter, served)
        log.info("LoRA adapter %r loaded: rank %d, scaling %g, from %s", name, adapter.rank, adapter.scaling, path)
        return adapter

    def allocate(self) -> None:
        """Fix the device layout (the class docstring) and make the first adapters resident.
        Once, before the KV budget is measured, so that it counts these bytes."""
        with self._lock:
            if self.reserve:
                head = self.model.get_output_embeddings()
                modules = {n for n, m in self.model.named_modules() if isinstance(m, torch.nn.Linear) and m is not head}
                slots, rank = self.max_loras, self.max_rank
            else:
                modules = {m for a in self._loaded.values() for m in a.weights}
                slots, rank = min(self.max_loras, len(self._loaded)), max((a.rank for a in self._loaded.values()), default=1)
            self.modules, self.rank = frozenset(modules), rank
            named = dict(self.model.named_modules())
            width = slots * rank
            # NOTE: the layers of one parent with one input width (q/k/v, gate/up) usually take
            # the same input: their A live in one matrix, so that one product serves them all
            # (`_Group`); each layer's A and B are views into their group's
            groups: dict[tuple[str, int], list[str]] = {}
            for name in sorted(modules):
                groups.setdefault((name.rpartition(".")[0], named[name].in_features), []).append(name)
            device = next(iter(self.model.parameters())).device
            self._columns = torch.arange(width, device=device) // rank + 1
            self._groups = {}
            with torch.no_grad():
                for members in groups.values():
                    first = named[members[0]]
                    dtype, where = _compute_dtype(first, self.model), first.weight.device
                    group = _Group(torch.zeros(len(members) * width, first.in_features, dtype=dtype, device=where), width)
                    for i, name in enumerate(members):
                        self._stacks[name] = (group.a[i * width : (i + 1) * width],
                                              torch.zeros(named[name].out_features, width, dtype=dtype, device=where))
                        self._groups[name] = (group, i)
                self._resident = [None] * slots
                for slot, adapter in enumerate(list(self._loaded.values())[:slots], start=1):
                    self._put(slot, adapter)

    def attach(self) -> None:
        """Wrap the targeted layers (the model runner calls it once it has packed the CPU
        weights, so the wrappers run the packed products)."""
        if self.modules is None:
            self.allocate()
        named = dict(self.model.named_modules())
        for name, (_, b) in self._stacks.items():
            if name not in self._layers:
                group, index = self._groups[name]
                self._layers[name] = _Layer(named[name], group, index, b, self._columns)

    # -- the engine thread -------------------------------------------------------------------

    def acquire(self, adapter: Adapter) -> int | None:
        """The slot `adapter` runs from for one more sequence, swapped in over the least
        recently used idle slot when it is not resident; None when every slot is held by
        running sequences (the sequence waits). AdapterGone once it is unloaded."""
        with self._lock:
            if self._loaded.get(adapter.name) is not adapter:
                raise AdapterGone(adapter.name)
            slot = next((s for s, a in enumerate(self._resident, start=1) if a is adapter), None)
            if slot is None:
                idle = [s for s, a in enumerate(self._resident, start=1) if a is None or not self._pins.get(a.name)]
                if not idle:
                    return None
                slot = min(idle, key=lambda s: (self._resident[s - 1] is not None, self._used.get(getattr(self._resident[s - 1], "name", ""), 0.0)))
                with torch.no_grad():
                    self._put(slot, adapter)
                self.swaps += 1
            self._pins[adapter.name] = self._pins.get(adapter.name, 0) + 1
            self._used[adapter.name] = time.monotonic()
            return slot

    def release(self, adapter: Adapter) -> None:
        """A sequence that `acquire`d the adapter's slot ended."""
        with self._lock:
            left = self._pins.get(adapter.name, 0) - 1
            if left > 0:
                self._pins[adapter.name] = left
            else:
                self._pins.pop(adapter.name, None)
            self._used[adapter.name] = time.monotonic()

    def remove(self, name: str) -> Adapter:
        """Unload adapter `name` (KeyError: none is loaded); its slot, if it has one, is free.
        Its sequences must have ended (the engine ends them first)."""
        with self._lock:
            adapter = self._loaded.pop(name)
            self._resident = [None if a is adapter else a for a in self._resident]
            self._pins.pop(name, None)
            self._used.pop(name, None)
            return adapter

    def _put(self, slot: int, adapter: Adapter) -> None:
        """Copy `adapter` into slot `slot`'s block of every targeted layer (zero where it
        has nothing)."""
        block = slice((slot - 1) * self.rank, slot * self.rank)
        for name, (a, b) in self._stacks.items():
            a[block].zero_()
            b[:, block].zero_()
            if name in adapter.weights:
                wa, wb = adapter.weights[name]
                a[block][: wa.shape[0]].copy_(wa)
                b[:, block][:, : wb.shape[1]].copy_(wb)
        old = self._resident[slot - 1]
        if old is not None:
            self._used.pop(old.name, None)
        self._resident[slot - 1] = adapter


class _Group:
    """The targeted layers of one parent that take one input width: their A stacked [G*width,
    in], so that when they are called on the same input one by one (q, k, v; gate, up), one
    product and one mask serve them all. The step's context keeps only the last input and
    hidden product, and another input is computed afresh: correct whoever calls it."""

    def __init__(self, a: torch.Tensor, width: int) -> None:
        self.a, self.width = a, width

    def hidden(self, step: context.StepContext, x: torch.Tensor, columns: torch.Tensor, index: int) -> torch.Tensor:
        """((x @ A_i.T) * mask) of member `index`: [..., width]."""
        last = step.memo.get(_Group)
        if last is None or last[0] is not self or last[1] is not x:
            h = _product(step, x, self.a)
            h = h.view(*h.shape[:-1], -1, self.width) * _mask(step, columns, x.dtype).unsqueeze(-2)
            step.memo[_Group] = last = (self, x, h)
        return last[2][..., index, :]


class _Layer:
    """One linear layer with the resident adapters' deltas added during a step."""

    def __init__(self, module: torch.nn.Linear, group: _Group, index: int, b: torch.Tensor, columns: torch.Tensor) -> None:
        original = module.forward

        def forward(x: torch.Tensor) -> torch.Tensor:
            y = original(x)
            step = context.current()
            if step is None or step.adapters is None:
                return y
            h = group.hidden(step, x, columns, index)
            if step.exact:
                return y + _product(step, h, b)
            # y += h @ B.T in one call (y is this layer's own fresh output)
            y.view(-1, y.shape[-1]).addmm_(h.reshape(-1, h.shape[-1]), b.t())
            return y

        module.forward = forward


def _compute_dtype(module: torch.nn.Linear, model) -> torch.dtype:
    """The dtype a layer computes in: its weight's, or the model's for a quantized weight."""
    return module.weight.dtype if module.weight.dtype.is_floating_point else model.dtype


def _product(step: context.StepContext, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T; in exact mode one call per whole tile of rows, as exact mode's own linear
    layers (server/engine/exact.py), so a row's delta never depends on the rows beside it."""
    if not step.exact:
        return F.linear(x, weight)
    tile = exact_mode.ROW_TILE if x.device.type == "cpu" else exact_mode.CUDA_ROW_TILE
    return exact_mode.by_tiles(lambda rows: F.linear(rows, weight), x, tile, one_call=False)


def _mask(step: context.StepContext, columns: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, C]: 1 where column c belongs to token t's adapter (made once per step and layout)."""
    key = (_mask, id(columns), dtype)
    mask = step.memo.get(key)
    if mask is None:
        mask = step.memo[key] = (step.adapters[:, None] == columns[None, :]).to(dtype)
    return mask
