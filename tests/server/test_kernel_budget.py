"""The kernels of one decode step (issue 47, bench/kernels.py) are exactly the budget in
bench/kernel_budget.json: per decoder layer, in the rest of the model's forward ("fixed") and in
the step's ops around it ("around"), counted on a 4-layer bf16 model at 1 and 64 rows.

Exact both ways, so the file records every change: a count above the budget fails (a change added
kernels: remove them or, if intended, raise the budget and say why in its "reason"); a count
below it fails too (lower the budget to the new count, saying what lowered it). A layer's
kernels must also be the same in every layer and at any number of rows.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from bench import kernels
from cache_manager import kv
from server.engine.model_runner import ModelRunner
from tests.device import DEVICE

BUDGET_FILE = Path(kernels.__file__).with_name("kernel_budget.json")
BUDGET = json.loads(BUDGET_FILE.read_text())
LAYERS = 4
ROWS = (1, 64)


@pytest.fixture(scope="module")
def counts() -> dict[int, kernels.Counts]:
    model = kernels.build(LAYERS, DEVICE)
    return {rows: kernels.count_decode_step(model, rows) for rows in ROWS}


def _ops(ops: Counter) -> str:
    return ", ".join(f"{name} {n}" for name, n in ops.most_common())


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("part", ["per_layer", "fixed", "around"])
def test_the_kernels_of_a_decode_step_are_the_budget(counts, rows, part):
    c = counts[rows]
    ops = {"per_layer": c.layers[0], "fixed": c.fixed, "around": c.around}[part]
    got, budget = kernels.split(ops), kernels.Split(**BUDGET[part])
    counted = f"{part} at {rows} rows: {got.non_gemm} non-GEMM + {got.gemm} GEMM kernels"
    if got.non_gemm > budget.non_gemm or got.gemm > budget.gemm:
        pytest.fail(f"{counted}, over the budget of {budget.non_gemm} + {budget.gemm} in bench/kernel_budget.json. Ops: {_ops(ops)}. "
                    'Remove the added kernels or, if they are intended, raise the budget and say why in its "reason".')
    if got != budget:
        pytest.fail(f"{counted}, under the budget of {budget.non_gemm} + {budget.gemm}: lower the budget in bench/kernel_budget.json "
                    f'to these counts and say what lowered them in its "reason" (ops: {_ops(ops)}).')


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_a_quantized_pool_adds_no_kernel_to_a_decode_step(counts, kv_dtype):
    """Over an fp8 or int8 pool a decode step launches what it launches over a plain one: the
    store quantizes in its one launch and the paged kernel reads the codes and scales (before,
    the quantizing took 23 (fp8) to 25 (int8) more kernels a layer, inside the opaque op, where
    no compiler fuses them)."""
    c = kernels.count_decode_step(kernels.build(LAYERS, DEVICE), 1, kv_dtype)
    plain = counts[1]
    assert c.layers[0] == plain.layers[0], f"{kv_dtype}: {_ops(c.layers[0])}; plain: {_ops(plain.layers[0])}"
    assert (c.fixed, c.around) == (plain.fixed, plain.around)


def test_the_kernels_of_a_mixed_step_are_the_budget():
    """A step of more than decode rows, every batch through the paged attention kernel (a GPU's
    way; what runs inside the compiled forward's opaque op): exactly its budget, per layer,
    fixed and around, the same in every layer; fewer than the gathered way, in every part."""
    model = kernels.build(LAYERS, DEVICE)
    c, gathered = kernels.count_mixed_step(model), kernels.count_mixed_step(model, kernel=False)
    budget = BUDGET["mixed"]
    for part, ops in {"per_layer": c.layers[0], "fixed": c.fixed, "around": c.around}.items():
        assert kernels.split(ops)._asdict() == budget[part], (f"the mixed step's {part}: {_ops(ops)}, the budget {budget[part]}: change "
                                                             'the code or the budget in bench/kernel_budget.json, saying why in its "reason"')
    assert all(layer == c.layers[0] for layer in c.layers)
    assert c.layers[0]["paged_attention"] == 2 and "scaled_dot_product_attention" not in c.layers[0]
    assert kernels.split(c.layers[0]).non_gemm < kernels.split(gathered.layers[0]).non_gemm
    assert sum(c.around.values()) < sum(gathered.around.values())


@pytest.fixture(scope="module")
def compiled_counts() -> list[kernels.CompiledCounts]:
    return kernels.count_compiled_steps(3, DEVICE)


def test_the_compiled_decode_step_is_its_budget(compiled_counts):
    """Compiled (server/engine/compiled.py): the kernels inductor generates per layer and outside
    the layers, for one row, for more and for the steps of more than decode rows ("mixed"), and
    the warm-up's compilations and graph breaks: a graph break, a compilation per layer or per
    bucket, or an added kernel fails here."""
    budget = BUDGET["compiled"]
    for c in compiled_counts:
        got = {"per_layer": kernels.split(c.per_layer)._asdict(), "fixed": kernels.split(c.fixed)._asdict(),
               "compilations": c.compilations, "graph_breaks": c.graph_breaks}
        want = {name: {**budget, **budget[c.step]}[name] if c.step == "mixed" else budget[name] for name in got}
        assert got == want, (f"the compiled step ({c.step}) has {got} (layer: {_ops(c.per_layer)}), the budget "
                             f'{want}: change the code or the budget in bench/kernel_budget.json, saying why in its "reason"')


def test_every_layer_launches_the_same_kernels(counts):
    for c in counts.values():
        for i, layer in enumerate(c.layers):
            assert layer == c.layers[0], f"at {c.rows} rows layer {i} launches {_ops(layer)}; layer 0 {_ops(c.layers[0])}"


def test_the_kernels_do_not_grow_with_rows(counts):
    one, many = counts[ROWS[0]], counts[ROWS[-1]]
    for part in ("layers", "fixed", "around"):
        a, b = getattr(one, part), getattr(many, part)
        assert a == b, f"{part}: {ROWS[0]} row(s) launch {a}, {ROWS[-1]} rows {b}"


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 8, dtype=torch.bfloat16)

    def forward(self, x):
        x = x.view(1, 4, 8).transpose(1, 2).reshape(8, 4).t()  # views only
        x = x.to(torch.bfloat16).transpose(0, 1).reshape(4, 8)  # a copy: the transposed tensor is not viewable as [4, 8]
        q = self.proj(x.float().to(torch.bfloat16)).view(1, 1, 4, 8)  # two dtype copies and one product
        return F.scaled_dot_product_attention(q, q, q)


@pytest.mark.parametrize("inference", [True, False])
def test_the_counter_counts_what_runs(inference):
    """Views and same-dtype conversions launch nothing; composite ops count as what they run
    (`reshape` a copy, `linear` a product); attention is one kernel."""
    layers = torch.nn.ModuleList([_Block()])
    model = torch.nn.Sequential(*layers)
    x = torch.ones(32, dtype=torch.bfloat16)
    with torch.inference_mode(inference), kernels.count_kernels(model, layers) as counter:
        model(x)
    ops = counter.counts(1).layers[0]
    # sdpa is decomposed before the mode sees it outside inference mode: a name of its fused kernel
    kinds = Counter({n if kernels.kind(n) != "attention" else "attention": k for n, k in ops.items()})
    assert kinds == Counter({"clone": 1, "_to_copy": 2, "addmm": 1, "attention": 1}), ops
    assert kernels.split(ops) == (4, 1) and not counter.counts(1).fixed and not counter.counts(1).around
    assert not model._forward_pre_hooks and not layers[0]._forward_hooks  # the hooks are gone


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3"])
def test_moe_experts_run_inside_the_captured_step(family):
    """MoE families (issue 47): a decode step on the capture path reads nothing back on the host
    (no `item`, `nonzero` or the like: CUDA graph capture fails on them), so their experts run
    inside the graph, through transformers' grouped_mm experts; the paths name it."""
    from bench import architectures

    model = architectures.build(family, DEVICE, torch.bfloat16)
    c = kernels.count_decode_step(model, 4)
    assert not c.syncs, f"{family}: a decode step waits for the device at {dict(c.syncs)}"
    assert any(kernels.kind(name) == "gemm" and "grouped" in name for name in c.layers[-1]), dict(c.layers[-1])
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 32, model.dtype), model.device, model.dtype)
    runner = ModelRunner(model, pool, paged=True, cuda_graphs=False, packed=None)
    runner.prepare()
    assert runner.paths["experts"].startswith("grouped_mm, "), runner.paths


def test_a_sync_in_the_step_is_seen():
    """The counter sees an op that reads a result back (what the test above rules out)."""
    with kernels.count_kernels(torch.nn.Identity(), []) as counter:
        x = torch.arange(4, device=DEVICE)
        x.nonzero()
        int(x.sum())
    assert counter.syncs["nonzero"] == 1 and counter.syncs["_local_scalar_dense"] == 1
