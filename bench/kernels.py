"""Kernels of one decode step (issue 47): the torch ops a CUDA graph of the model runner's decode
path replays, so that fewer kernels per layer show as progress and a change that adds some fails
`tests/server/test_kernel_budget.py` (against `bench/kernel_budget.json`).

    .venv/bin/python -m bench.kernels [--layers 28] [--rows 1 64] [--json]

The model: random bf16 weights with Qwen2.5-1.5B's structure (biased q/k/v, 12 query heads over
2 KV heads, RMSNorm, SiLU MLP, tied head, 28 layers) at small widths, which a count does not
depend on. R rows are prefilled with PROMPT tokens each; one decode step of all R then runs
through `ModelRunner.forward` on the paged path (bucket padding, persistent buffers): the body
that graph capture records, here eagerly (`cuda_graphs=False`; `packed=None` and the paged
decode kernel and merged projections, as the server runs).

A TorchDispatchMode (`count_kernels`) counts the ops and forward hooks attribute them to a decoder
layer, to "fixed" (the rest of the model's forward: embedding, rotary embedding, final norm, LM
head) or to "around" (the step's ops around the model's forward: the persistent buffer's fill,
the batch's gather index and masks, the logits' float copy). Which ops are kernels is decided in
one place (`kind`, `launches_kernel`). The baseline, in the same run: plain transformers on the
same weights (sdpa, a StaticCache holding the same prompts), one token per row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch._library.custom_ops import OPDEFS
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM, StaticCache

from cache_manager import kv
from server.engine.attention import Row
from server.engine.model_runner import ModelRunner

LAYERS = 28
PROMPT = 5  # tokens prefilled per row before the counted step
GOAL = (6, 4)  # issue 47's aim per layer: non-GEMM, GEMM kernels
CONFIG = {  # Qwen2.5-1.5B's structure at small widths (head_dim 8)
    "vocab_size": 1000, "hidden_size": 96, "intermediate_size": 256, "num_attention_heads": 12, "num_key_value_heads": 2,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": True,
    "bos_token_id": 1, "eos_token_id": 2,
}


def build(layers: int = LAYERS, device: torch.device | str = "cpu"):
    """The seeded random-weight bf16 model, in eval mode."""
    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen2", num_hidden_layers=layers, **CONFIG)
    return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).to(device).eval()


# -- what counts as a kernel: change here (only) when the counted code needs it ---------------

NO_KERNEL = frozenset({  # allocations, metadata and host-side copies (views and queries: `launches_kernel`)
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "_unsafe_view", "lift_fresh", "_pin_memory",
    "detach_", "t_", "transpose_", "squeeze_", "unsqueeze_", "as_strided_", "resize_", "set_",  # in-place metadata
})
GEMM = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "_addmm_activation", "_int_mm", "_scaled_mm", "mkldnn_linear",
    "_grouped_mm", "grouped_mm",  # MoE experts (transformers' grouped_mm implementation)
})
GEMM_PREFIXES = ("_weight_int",)  # _weight_int4pack_mm, _weight_int8pack_mm, ...
# ops whose result the host must read (a device-to-host sync): none may run in a captured decode
# step (CUDA graph capture fails on them, and an eager step waits on each)
SYNC = frozenset({"_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive", "masked_select",
                  "equal", "is_nonzero", "_assert_async", "item"})
ATTENTION = ("scaled_dot_product", "flash_attention", "efficient_attention", "paged_attention")  # one fused kernel, never decomposed
ONE_KERNEL = (*ATTENTION, "store_kv")  # ops counted as the one kernel they launch on CUDA, not by what runs in them here


def kind(name: str) -> str:
    """"gemm", "attention" or "other" for an op that launches a kernel (by its packet name)."""
    if name in GEMM or name.startswith(GEMM_PREFIXES):
        return "gemm"
    return "attention" if any(a in name for a in ATTENTION) else "other"


def launches_kernel(func) -> bool:
    """Whether a non-composite op launches a kernel: not a view (its output aliases its input,
    by the op's schema), nor a query (it returns no tensor: sizes, `is_pinned`, sdpa's backend
    choice, `item`), nor in NO_KERNEL."""
    if func.is_view or func.overloadpacket.__name__ in NO_KERNEL:
        return False
    return any("Tensor" in str(r.type) for r in func._schema.returns)


class Split(NamedTuple):
    non_gemm: int
    gemm: int


def split(ops: Counter) -> Split:
    gemm = sum(n for name, n in ops.items() if kind(name) == "gemm")
    return Split(sum(ops.values()) - gemm, gemm)


# -- counting ---------------------------------------------------------------------------------


@dataclass(slots=True)
class Counts:
    """The kernels of one decode step of `rows` rows, by op name: per decoder layer, the rest of
    the model's forward (`fixed`), and the step's ops around it (`around`, not in `total`)."""

    rows: int
    layers: list[Counter]
    fixed: Counter
    around: Counter
    syncs: Counter  # SYNC ops anywhere in the step, by name

    @property
    def per_layer(self) -> Split:
        """Layer 0's (the test checks that every layer has the same)."""
        return split(self.layers[0])

    @property
    def total(self) -> int:
        return sum(sum(c.values()) for c in self.layers) + sum(self.fixed.values())

    def as_dict(self) -> dict:
        return {"rows": self.rows, "layers": len(self.layers), "per_layer": self.per_layer._asdict(), "fixed": split(self.fixed)._asdict(),
                "total": self.total, "around": split(self.around)._asdict(),
                "layer_ops": dict(self.layers[0]), "fixed_ops": dict(self.fixed), "around_ops": dict(self.around), "syncs": dict(self.syncs)}


class KernelCounter(TorchDispatchMode):
    """Counts the kernels launched while active (`count_kernels`), by where they run: "around"
    `model`'s forward, "fixed" inside it, or the index of the one of `layers` running. Composite
    ops are decomposed (with the mode active) so that what is counted is what runs: `to` is a
    copy or nothing, `reshape` a view or a copy, `linear` a view and a product; so are kvserve's
    own custom ops but the one-kernel ones, ONE_KERNEL (`decode_attention` is a store and a read).

    NOTE: under inference mode the mode sees composite ops undecomposed (torch 2.13), and their
    schemas mark `to` and `reshape` as views: filtered by schema, their copies would vanish."""

    def __init__(self, model, layers) -> None:
        super().__init__()
        self.model, self.layers, self.where = model, list(layers), "around"
        self.ops: dict[object, Counter] = {}
        self.syncs: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC:
            self.syncs[name] += 1
        one = any(k in name for k in ONE_KERNEL)
        if func.namespace == "kvserve" and not one:  # kvserve's own op of several: what it launches
            with self:
                return OPDEFS[func.name()]._init_fn(*args, **kwargs)
        if not one:
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if one or launches_kernel(func):  # (a store returns nothing, and launches its kernel)
            self.ops.setdefault(self.where, Counter())[name] += 1
        return func(*args, **kwargs)

    def counts(self, rows: int) -> Counts:
        layers = [self.ops.get(i, Counter()) for i in range(len(self.layers))]
        return Counts(rows, layers, self.ops.get("fixed", Counter()), self.ops.get("around", Counter()), self.syncs)


@contextlib.contextmanager
def count_kernels(model, layers) -> Iterator[KernelCounter]:
    """A KernelCounter, active in the block, with its forward hooks on `model` and each of `layers`."""
    counter = KernelCounter(model, layers)

    def at(where):
        def hook(*_) -> None:
            counter.where = where
        return hook

    hooks = [model.register_forward_pre_hook(at("fixed")), model.register_forward_hook(at("around"))]
    for i, layer in enumerate(counter.layers):
        hooks += [layer.register_forward_pre_hook(at(i)), layer.register_forward_hook(at("fixed"))]
    try:
        with counter:
            yield counter
    finally:
        for hook in hooks:
            hook.remove()


def _prompt(row: int, vocab: int) -> list[int]:
    return [(7 * row + 3 * t) % (vocab - 3) + 3 for t in range(PROMPT)]


@contextlib.contextmanager
def _paged_runner(model, rows: int, kv_dtype: str = "auto", kernel: bool = True) -> Iterator[tuple[ModelRunner, list[kv.SequenceKV]]]:
    """A model runner on the paged path as the server runs it (`packed=None`, merged
    projections, no graphs) over a KV pool in `kv_dtype` holding `rows` caches of PROMPT + 1
    tokens' room, freed after. `kernel`: attention through the paged attention kernel (as on
    CUDA: one op a layer; on CPU it runs the reference or Triton's interpreter, but counts as
    the one kernel CUDA launches). Switches `model` to kvserve's attention (`attention.enable`)."""
    dtype = model.dtype
    pool = kv.Pool(model.config, kv.bytes_for(model.config, PROMPT + 1, dtype, kv_dtype) * rows, model.device, dtype, kv_dtype=kv_dtype)
    runner = ModelRunner(model, pool, paged=True, cuda_graphs=False, packed=None, max_rows=rows, attention_kernel=kernel, merge=True)
    caches = [pool.allocate(PROMPT + 1) for _ in range(rows)]
    try:
        yield runner, caches
    finally:
        for cache in caches:
            kv.free(cache)
        pool.release()


def count_decode_step(model, rows: int, kv_dtype: str = "auto") -> Counts:
    """kvserve's decode step of `rows` rows through the model runner's paged path (see the
    module docstring), over a KV pool in `kv_dtype`."""
    vocab = model.config.vocab_size
    with _paged_runner(model, rows, kv_dtype) as (runner, caches):
        prompts = [t for r in range(rows) for t in _prompt(r, vocab)]
        next_ids = runner.forward([Row(c, PROMPT) for c in caches], prompts, list(range(rows))).argmax(-1).tolist()
        with count_kernels(model, model.model.layers) as counter:
            runner.forward([Row(c, 1) for c in caches], next_ids, list(range(rows)))
    return counter.counts(rows)


def count_mixed_step(model, kernel: bool = True) -> Counts:
    """A step of more than decode rows through the model runner's paged path, eagerly: two
    decode rows (each holding a prompt) beside a new row's PROMPT-token prompt, as a compiled
    forward's opaque `step_attention` runs its batches. `kernel`: every batch attends through
    the paged attention kernel (a GPU's way); otherwise the multi-token batch gathers its
    bucket and masks it."""
    vocab = model.config.vocab_size
    with _paged_runner(model, 3, kernel=kernel) as (runner, caches):
        prompts = [_prompt(r, vocab) for r in range(3)]
        next_ids = runner.forward([Row(c, PROMPT) for c in caches[:2]], prompts[0] + prompts[1], [0, 1]).argmax(-1).tolist()
        with count_kernels(model, model.model.layers) as counter:
            runner.forward([Row(caches[0], 1), Row(caches[1], 1), Row(caches[2], PROMPT)], next_ids + prompts[2], [0, 1, 2])
    return counter.counts(3)


# a kvserve op's kernels, as the eager counter counts them inside it (plain KV: the K and V store
# kernel, the paged decode kernel)
INSIDE = {"decode_attention": Counter({"store_kv": 1, "paged_attention": 1})}
_CALL = re.compile(r"^\s+(?:\w+ = )?(?:extern_kernels\.(\w+)\(|torch\.ops\.\w+\.(\w+)\.\w+\(|(cpp_fused_\w+|triton_\w+)(?:\.run)?\()", re.M)


@dataclass(slots=True)
class CompiledCounts:
    """The kernels of one compiled step (`count_compiled_steps`): per layer, fixed (the rest of
    the forward) and the compilations and graph breaks its warm-up made. `step`: "1" and "2+"
    (decode rows), "mixed" (more than decode rows)."""

    step: str
    per_layer: Counter
    fixed: Counter
    compilations: int
    graph_breaks: int

    def as_dict(self) -> dict:
        return {"step": self.step, "per_layer": split(self.per_layer)._asdict(), "fixed": split(self.fixed)._asdict(),
                "compilations": self.compilations, "graph_breaks": self.graph_breaks, "layer_ops": dict(self.per_layer)}


def kernel_calls(code: str) -> list[str]:
    """The kernels inductor's generated `call` launches, in order, by name: its fused kernels
    ("fused"), extern kernels (`mm`) and ops it calls as they are (`decode_attention`, expanded
    to what runs inside it by INSIDE)."""
    body = code[code.index("def call("):]
    calls = []
    for extern, op, fused in _CALL.findall(body):
        name = extern or op or "fused"
        calls += list(INSIDE[name].elements()) if name in INSIDE else [name]
    return calls


def count_compiled_steps(layers: int, device: torch.device | str = "cpu") -> list[CompiledCounts]:
    """The forward compiled (server/engine/compiled.py) on the model of `build(layers)`, its
    kernels read from the code inductor generates at warm-up: decode steps of one row and of
    more (dynamic in the rows: one graph for every bucket above 1, counted as 2 rows), and the
    steps of more than decode rows ("mixed"), whose attention is the one opaque op
    `step_attention`, counted once (inside it the step's batches run their kernels as eagerly).
    Per layer: the calls from one layer's attention to the next (the code is unrolled, so every
    such period is the same; at least 3 layers). The compilations and graph breaks are the
    warm-up's (all three graphs).

    NOTE: on CPU the fused kernels are inductor's C++ ones; its fusion decisions follow the same
    scheduler as on CUDA, so the count is a proxy for Triton's, not the same number."""
    from torch._inductor.utils import run_and_get_code

    from server.engine import compiled

    torch._dynamo.reset()
    model = build(layers, device)
    pool = kv.Pool(model.config, kv.bytes_for(model.config, PROMPT + 1, model.dtype) * 2, model.device, model.dtype)
    runner = ModelRunner(model, pool, paged=True, cuda_graphs=False, packed=None, max_rows=2, attention_kernel=True, merge=True,
                         compile="require")
    before, breaks = compiled.compilations(), compiled.graph_breaks()
    try:
        _, codes = run_and_get_code(runner.prepare)
    finally:
        pool.release()
    if runner.paths.get("compile") != "decode+mixed":
        raise RuntimeError(f"the forward did not compile: {runner.fallbacks.get('compile')}")
    made, broke = compiled.compilations() - before, compiled.graph_breaks() - breaks
    out = []
    for step, code in zip(("1", "2+", "mixed"), codes, strict=True):
        calls = kernel_calls(code)
        starts = [i for i, name in enumerate(calls) if kind(name) == "attention" or name == "step_attention"]
        periods = {tuple(calls[a:b]) for a, b in zip(starts, starts[1:])}
        if len(starts) != layers or len(periods) != 1:
            raise RuntimeError(f"the compiled layers are not alike: {len(starts)} attention calls, {len(periods)} periods")
        per_layer = Counter(periods.pop())
        fixed = Counter(calls)
        fixed.subtract({name: n * layers for name, n in per_layer.items()})
        out.append(CompiledCounts(step, per_layer, +fixed, made, broke))
    return out


@torch.inference_mode()
def count_transformers_step(model, rows: int) -> Counts:
    """Plain transformers' decode step on `model`'s weights: a fresh model with sdpa attention
    (kvserve's `enable` switches the one it runs), a StaticCache holding each row's prompt, one
    token per row (`generate`'s inputs: positions and cache positions given). Before kvserve's
    runner has run on `model`: its state dict is transformers' until then."""
    config = type(model.config).from_dict(model.config.to_dict())
    plain = AutoModelForCausalLM.from_config(config, dtype=model.dtype, attn_implementation="sdpa").to(model.device).eval()
    plain.load_state_dict(model.state_dict())
    device = model.device
    cache = StaticCache(config=plain.config, max_cache_len=PROMPT + 1)
    prompts = torch.tensor([_prompt(r, config.vocab_size) for r in range(rows)], device=device)
    next_ids = plain(input_ids=prompts, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    positions, cache_position = torch.full((rows, 1), PROMPT, device=device), torch.tensor([PROMPT], device=device)
    with count_kernels(plain, plain.model.layers) as counter:
        plain(input_ids=next_ids, position_ids=positions, cache_position=cache_position, past_key_values=cache, use_cache=True)
    return counter.counts(rows)


# -- the report -------------------------------------------------------------------------------


def _row(label: str, c: Counts) -> str:
    layer, fixed = c.per_layer, split(c.fixed)
    return (f"| {label} | {c.rows} | {layer.non_gemm} | {layer.gemm} | {fixed.non_gemm} + {fixed.gemm} | {c.total:,} | "
            f"{sum(c.around.values())} |")


def _ratio(a: int, b: int) -> str:
    return f"{a / b:.2f}x" if b else "-"


def table(pairs: list[tuple[Counts, Counts]]) -> str:
    """The markdown report of (kvserve, transformers) counts at each row count."""
    layers = len(pairs[0][0].layers)
    lines = [f"Kernels of one decode step, Qwen2.5-1.5B's structure ({layers} layers), bf16, "
             f"{', '.join(str(k.rows) for k, _ in pairs)} rows; fixed = non-GEMM + GEMM outside the layers; "
             "model total = layers + fixed; around = the step's ops around the model's forward (not in the total).", "",
             "| | rows | non-GEMM / layer | GEMM / layer | fixed | model total | around |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for ours, theirs in pairs:
        lines += [_row("kvserve (paged decode, the graph's body)", ours), _row("transformers (sdpa, StaticCache)", theirs)]
        lines.append(f"| kvserve / transformers | {ours.rows} | {_ratio(ours.per_layer.non_gemm, theirs.per_layer.non_gemm)} | "
                     f"{_ratio(ours.per_layer.gemm, theirs.per_layer.gemm)} | | {_ratio(ours.total, theirs.total)} | |")
    ours, theirs = pairs[0]
    lines += ["", f"Goal (issue 47): <= {GOAL[0]} non-GEMM and <= {GOAL[1]} GEMM kernels per layer.", "",
              f"One layer's kernels by op ({ours.rows} row{'s' * (ours.rows > 1)}):", "",
              "| op | kind | kvserve | transformers |", "|---|---|---:|---:|"]
    ops = sorted(set(ours.layers[0]) | set(theirs.layers[0]), key=lambda n: (kind(n), -ours.layers[0][n], n))
    lines += [f"| {n} | {kind(n)} | {ours.layers[0][n]} | {theirs.layers[0][n]} |" for n in ops]
    for label, c in (("kvserve", ours), ("transformers", theirs)):
        lines.append(f"\n{label}, fixed: " + ", ".join(f"{n} {k}" for n, k in sorted(c.fixed.items())) +
                     "; around: " + (", ".join(f"{n} {k}" for n, k in sorted(c.around.items())) or "-"))
    return "\n".join(lines)


def compiled_table(compiled: list[CompiledCounts], theirs: Counts, layers: int) -> str:
    """The compiled step's counts beside transformers' (its per-layer and fixed counts at `layers`)."""
    lines = ["", f"Compiled (inductor, its generated code on CPU; one graph for 1 row, one for every other bucket, one for the steps of "
             f"more than decode rows, whose opaque attention op counts once), at {layers} layers:", "",
             "| step | non-GEMM / layer | GEMM / layer | fixed | model total | vs transformers | compilations | graph breaks |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in compiled:
        layer, fixed = split(c.per_layer), split(c.fixed)
        total = (layer.non_gemm + layer.gemm) * layers + fixed.non_gemm + fixed.gemm
        lines.append(f"| {c.step} | {layer.non_gemm} | {layer.gemm} | {fixed.non_gemm} + {fixed.gemm} | {total:,} | "
                     f"{_ratio(total, theirs.total)} | {c.compilations} | {c.graph_breaks} |")
    for c in compiled[1:]:
        lines.append(f"\nOne compiled layer ({c.step}): " + ", ".join(f"{n} {k}" for n, k in c.per_layer.most_common()))
    return "\n".join(lines)


def mixed_table(through: Counts, gathered: Counts) -> str:
    """A step of more than decode rows, eagerly (`count_mixed_step`): through the paged attention
    kernel beside the gathered way."""
    lines = ["", "A step of more than decode rows (2 decode rows beside a new row's prompt), eagerly, as inside the compiled "
             "forward's opaque attention op:", "",
             "| batches attend | non-GEMM / layer | GEMM / layer | fixed | around | model total |", "|---|---:|---:|---:|---:|---:|"]
    for label, c in (("through the paged attention kernel", through), ("gathered, masked", gathered)):
        layer, fixed, around = c.per_layer, split(c.fixed), split(c.around)
        lines.append(f"| {label} | {layer.non_gemm} | {layer.gemm} | {fixed.non_gemm} + {fixed.gemm} | {sum(around)} | {c.total:,} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--json", action="store_true", help="print the counts as JSON instead of tables")
    args = parser.parse_args()
    model = build(args.layers)
    # NOTE: transformers first: kvserve's runner merges the model's projections (server/engine/merged.py)
    theirs = [count_transformers_step(model, rows) for rows in args.rows]
    pairs = list(zip([count_decode_step(model, rows) for rows in args.rows], theirs))
    mixed = count_mixed_step(model), count_mixed_step(model, kernel=False)
    compiled = count_compiled_steps(max(args.layers, 3))
    if args.json:
        print(json.dumps({**{str(o.rows): {"kvserve": o.as_dict(), "transformers": t.as_dict()} for o, t in pairs},
                          "mixed": {"kernel": mixed[0].as_dict(), "gathered": mixed[1].as_dict()},
                          "compiled": [c.as_dict() for c in compiled]}, indent=2))
    else:
        print(table(pairs))
        print(mixed_table(*mixed))
        print(compiled_table(compiled, pairs[0][1], args.layers))


if __name__ == "__main__":
    main()
