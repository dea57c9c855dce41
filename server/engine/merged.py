"""Merged projections: the linear layers of one module that take the same input (an attention's
q_proj/k_proj/v_proj, an MLP's gate_proj/up_proj) computed as one GEMM over their concatenated
weights, at load. One product of the summed width keeps the machine busier than
three narrow ones at the few rows of a decode step, and is one packed weight (cpu_linear), one
exact-mode layer (exact.enable) and one kernel launch instead of three.

transformers' modeling code keeps calling `self.q_proj(x)`, `self.k_proj(x)`, `self.v_proj(x)`:
each member becomes a `_Slice` of its group, whose fused layer is a plain `nn.Linear` registered
beside them (`qkv_merged`, `gate_up_merged`), so the packers and exact mode switch it like any
other layer and skip the slices. Families whose checkpoints are fused already (Phi-3's
qkv_proj, gate_up_proj; MoE experts stored as one 3-D weight) have nothing to merge.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import nn

from server.engine.cpu_linear import dense

GROUPS = {"qkv_merged": ("q_proj", "k_proj", "v_proj"), "gate_up_merged": ("gate_proj", "up_proj")}


@dataclass(slots=True)
class Merged:
    """What `merge` did: groups merged per fused layer's name, groups left apart per reason."""

    merged: Counter = field(default_factory=Counter)  # "qkv_merged" / "gate_up_merged" -> groups
    apart: Counter = field(default_factory=Counter)  # reason -> groups

    def describe(self) -> str:
        """One line for the engine's paths report, e.g. "qkv 24, gate_up 24; apart: 2 skipped"."""
        done = ", ".join(f"{name.removesuffix('_merged')} {n}" for name, n in self.merged.items()) or "none"
        apart = ", ".join(f"{n} {why}" for why, n in self.apart.items())
        return done + (f"; apart: {apart}" if apart else "")


def merge(model: nn.Module, *, skip: frozenset[str] | set[str] = frozenset()) -> Merged:
    """Merge every group of `GROUPS` in `model` whose members are dense floating-point
    `nn.Linear` layers over one input width, dtype and device, with a bias on all or none
    (`_why_apart` names what else keeps a group apart: a member named in `skip`, such as a
    LoRA adapter's target, a quantized layer, a layer already switched). The members'
    weights are freed: the fused weight is their only copy, so the parameter count and bytes
    stay as they were. Idempotent: a second call reports what the first merged.

    NOTE: before cpu_linear.pack_model, exact.enable and LoRA's attach, which switch the layers
    they find (a layer they switched first stays apart, "switched")."""
    report = Merged()
    memo = _Memo()  # NOTE: one per model: at most one group's output is kept (`_Group.take`)
    for path, parent in list(model.named_modules()):
        for fused_name, names in GROUPS.items():
            layers = [getattr(parent, name, None) for name in names]
            if not all(isinstance(layer, nn.Module) for layer in layers):
                continue  # not this group
            if all(isinstance(layer, _Slice) for layer in layers):
                report.merged[fused_name] += 1  # merged already (another runner of the model)
                continue
            reason = _why_apart(layers, [f"{path}.{name}" if path else name for name in names], skip)
            if reason:
                report.apart[reason] += 1
                continue
            _fuse(parent, fused_name, names, layers, memo)
            report.merged[fused_name] += 1
    return report


def _why_apart(layers: list[nn.Module], paths: list[str], skip) -> str | None:
    """Why this group cannot be merged, or None."""
    if any(path in skip for path in paths):
        return "skipped"
    if not all(dense(layer) for layer in layers):
        return "quantized"  # or not a linear layer at all; each runs its own kernels
    if any("forward" in vars(layer) for layer in layers):
        return "switched"
    first = layers[0].weight
    if any((w.shape[1], w.dtype, w.device) != (first.shape[1], first.dtype, first.device) for w in (layer.weight for layer in layers)):
        return "mismatched"
    if len({layer.bias is None for layer in layers}) > 1:
        # NOTE: a zero bias for the others is not bit-exact: F.linear adds a bias inside the
        # GEMM (addmm, beta=1), which may round otherwise than a product without one
        return "bias on some"
    return None


def _fuse(parent: nn.Module, fused_name: str, names: tuple[str, ...], layers: list[nn.Linear], memo: _Memo) -> None:
    """Register the group's fused layer on `parent` as `fused_name` and put `_Slice`s in place
    of its members (whose weights are then unreferenced: freed)."""
    first = layers[0]
    with torch.no_grad():
        weight = torch.cat([layer.weight for layer in layers])
        bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
    fused = nn.Linear(first.in_features, weight.shape[0], bias=bias is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=first.weight.requires_grad)
    if bias is not None:
        fused.bias = nn.Parameter(bias, requires_grad=first.bias.requires_grad)
    setattr(parent, fused_name, fused)
    group = _Group(fused, memo, len(layers))
    start = 0
    for index, (name, layer) in enumerate(zip(names, layers)):
        setattr(parent, name, _Slice(group, index, slice(start, start + layer.out_features)))
        start += layer.out_features


class _Memo:
    """The last fused output of a model's groups: (group, input, output, members served)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last: tuple[_Group, torch.Tensor, torch.Tensor, set[int]] | None = None


class _Group:
    """A fused layer and the members that share its output."""

    def __init__(self, fused: nn.Linear, memo: _Memo, members: int) -> None:
        self.fused, self.memo, self.members = fused, memo, members

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """The fused output for `x` (all columns): computed by the first member called with
        `x`, served to the others called with the same tensor object.

        NOTE: the memo holds one group's output, model-wide, and drops it once every member has
        taken its columns, so nothing outlives the call pattern of transformers' layers (q, k,
        v; gate, up, one after another), and a layer that skips a member (a KV-shared layer)
        keeps at most one output alive until the next group runs. A member called with another
        input, or twice, recomputes the whole fused product rather than its own rows: slower,
        but through the same switched layer (packed, exact mode's tiles), so its bits never
        depend on the order of the calls. Identity, not values: the memo holds `x` itself, so
        its id cannot be reused."""
        last = self.memo.last
        if last is None or last[0] is not self or last[1] is not x or index in last[3]:
            last = (self, x, self.fused(x), set())
        last[3].add(index)
        self.memo.last = None if len(last[3]) == self.members else last
        return last[2]


class _Slice(nn.Module):
    """A merged member: its columns of the group's output. Not an `nn.Linear` (packers, exact
    mode and LoRA pass it by); `weight` and `bias` are views of the fused layer's rows, for
    modeling code that reads them (a dtype)."""

    def __init__(self, group: _Group, index: int, rows: slice) -> None:
        super().__init__()
        self.group, self.index, self.rows = group, index, rows
        self.in_features, self.out_features = group.fused.in_features, rows.stop - rows.start

    @property
    def weight(self) -> torch.Tensor:
        return self.group.fused.weight[self.rows]

    @property
    def bias(self) -> torch.Tensor | None:
        bias = self.group.fused.bias
        return None if bias is None else bias[self.rows]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.take(self.index, x)[..., self.rows]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rows={self.rows.start}:{self.rows.stop} of the merged layer"
