"""The paged decode kernel (server/engine/paged_kernel.py) against its torch reference and
against the paged path it replaces (attention.py `_attend` over a gathered bucket with an
additive mask), on random pools with scattered block tables, padding rows, GQA, Dk != Dv,
head sizes that are not powers of two, windows, soft-capping, sinks and split contexts; and
the custom op's dispatch, schema and fake implementation (torch.compile, fullgraph).

On CPU Triton's interpreter runs the kernels (tests/conftest.py sets TRITON_INTERPRET=1): a
program at a time with NumPy, slow, so the shapes are small."""

from __future__ import annotations

import math

import pytest
import torch

from cache_manager import kv
from server.engine import paged_kernel
from server.engine.attention import _attend
from server.engine.context import additive
from tests.device import DEVICE

pytestmark = pytest.mark.skipif(not paged_kernel.runs_triton(DEVICE), reason=f"no Triton kernel on {DEVICE} (no Triton, or no interpreter)")

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


class Case:
    """A random pool and a batch over it: `lengths[b]` tokens held by row b (its query at
    position length - 1), None for a padding row (position 0, a table of trash blocks); each
    row's blocks scattered over the pool's `num_blocks`, the trash block (the last) past its
    end. `width` T: rows of T queries each (positions [B, T]), the last T of a row's tokens (a
    row holding fewer repeats its last position, as a padding token does); None: one query a
    row, positions [B]."""

    def __init__(self, lengths, groups=2, kv_heads=2, dk=32, dv=None, block_size=kv.BLOCK_SIZE, max_blocks=8, num_blocks=24,
                 dtype=torch.float32, seed=0, softcap=None, sinks=False, window=None, latent=False, width=None, kv_dtype="auto"):
        """`latent`: an MLA latent pool (`mla.meet`): keys are the rotary keys (dk), values the
        latent (dv), and the absorbed queries are dv + dk wide. `kv_dtype`: the pool's format
        (`kv.KV_DTYPES`): fp8 or int8 codes and a scale a slot, as the pool stores them."""
        gen = torch.Generator().manual_seed(seed)
        dv = dv or dk
        slots = (num_blocks + 1) * block_size
        self.trash = slice(num_blocks * block_size, slots)
        self.block_size, self.softcap, self.window = block_size, softcap, window
        self.scale = (dk + dv if latent else dk) ** -0.5
        self.keys = torch.randn(kv_heads, slots, dk, generator=gen).to(DEVICE, dtype)
        self.values = torch.randn(kv_heads, slots, dv, generator=gen).to(DEVICE, dtype)
        self.kv_dtype, self.key_scales, self.value_scales = kv_dtype, None, None
        if kv_dtype != "auto":
            fmt = kv.kv_format(kv_dtype)
            (self.keys, self.key_scales), (self.values, self.value_scales) = fmt.encode(self.keys), fmt.encode(self.values)
        t = width or 1
        self.q = torch.randn(len(lengths), kv_heads, groups * t, dk + dv if latent else dk, generator=gen).to(DEVICE, dtype)
        self.sinks = torch.randn(kv_heads, groups, generator=gen).to(DEVICE) if sinks else None
        tables = torch.full((len(lengths), max_blocks), num_blocks, dtype=torch.int64)
        for b, n in enumerate(lengths):
            if n is not None:
                used = -(-n // block_size)
                tables[b, :used] = torch.randperm(num_blocks, generator=gen)[:used]
        self.tables = tables.to(DEVICE)
        held = [n or 1 for n in lengths]
        positions = [[max(n - t, 0) + min(i, n - 1) for i in range(t)] for n in held]
        self.positions = torch.tensor(positions if width else [p[0] for p in positions], dtype=torch.int64, device=DEVICE)
        self.reach = None

    def args(self):
        return (self.q, self.keys, self.values, self.tables, self.positions, self.block_size, self.scale, self.softcap,
                self.sinks, self.window, self.reach, self.key_scales, self.value_scales, self.kv_dtype)

    def kernel(self, **kw):
        return paged_kernel.paged_attention_triton(*self.args(), **kw)

    def reference(self):
        return paged_kernel.paged_attention_reference(*self.args())


def assert_close(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.isfinite(got).all()
    tolerance = TOLERANCE[got.dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tolerance, rtol=tolerance)


LENGTHS = [1, 16, 17, 45, 128, None]  # 1 token, a whole block, one past it, mid-block, the whole bucket, padding

CASES = {
    "mha": dict(groups=1, dk=64),
    "gqa2": dict(groups=2, dk=32),
    "gqa4-head80": dict(groups=4, dk=80),
    "gqa7-dk48-dv80": dict(groups=7, kv_heads=1, dk=48, dv=80),
    "gqa12-dk16": dict(groups=12, kv_heads=1, dk=16),
    "window": dict(groups=2, window=20),
    "softcap": dict(groups=2, softcap=5.0),
    "sinks": dict(groups=4, sinks=True),
    "block4-all": dict(groups=2, block_size=4, max_blocks=8, window=9, softcap=3.0, sinks=True),
    "chunked": dict(groups=2, window=-24),  # Llama 4's chunked attention (kv.Layout)
    # an MLA latent pool: one KV head, the rotary key (16) and the latent (48), 8 absorbed query heads
    "latent": dict(groups=8, kv_heads=1, dk=16, dv=48, latent=True),
    "latent-block4-split": dict(groups=5, kv_heads=1, dk=8, dv=40, latent=True, block_size=4, max_blocks=8, softcap=4.0),
    "block4-chunked": dict(groups=2, block_size=4, max_blocks=8, window=-6, sinks=True),
    # more query heads on the latent than one program holds (paged_kernel.ACCUMULATOR / 512), as DeepSeek-V3's 128
    "latent-many-heads": dict(groups=80, kv_heads=1, dk=8, dv=264, latent=True, sinks=True),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_reference_fp32(name):
    config = CASES[name]
    lengths = LENGTHS if config.get("block_size", 16) == 16 else [1, 4, 5, 14, 32, None]
    case = Case(lengths, **config)
    assert_close(case.kernel(), case.reference())


@pytest.mark.parametrize("name", ["gqa4-head80", "gqa7-dk48-dv80", "block4-all", "chunked", "latent", "latent-many-heads"])
def test_matches_reference_bf16(name):
    config = CASES[name]
    lengths = LENGTHS if config.get("block_size", 16) == 16 else [1, 4, 5, 14, 32, None]
    case = Case(lengths, dtype=torch.bfloat16, **config)
    assert_close(case.kernel(), case.reference())


def test_padding_rows_are_finite_whatever_the_trash_block_holds():
    case = Case([None, None, 30], groups=2)
    case.keys[:, case.trash] = 1e4 * torch.randn_like(case.keys[:, case.trash])
    out = case.kernel()
    assert torch.isfinite(out).all()
    assert_close(out[2:], case.reference()[2:])


@pytest.mark.parametrize("window", [24, -24])
def test_reads_only_what_the_row_sees(window):
    """NaNs in every slot the rows cannot see (past their ends, before their windows or
    chunks, other blocks of the pool) change nothing: those keys are never weighed, not
    weighed by zero."""
    case = Case([40, 70, 3], groups=2, window=window, softcap=4.0)
    want = case.reference()
    seen = torch.zeros(case.keys.shape[1], dtype=torch.bool)
    for b, pos in enumerate(case.positions.tolist()):
        first = max(0, pos - window + 1) if window > 0 else pos - pos % -window
        for p in range(first, pos + 1):
            seen[case.tables[b, p // case.block_size] * case.block_size + p % case.block_size] = True
    case.keys[:, ~seen] = float("nan")
    case.values[:, ~seen] = float("nan")
    assert_close(case.kernel(), want)


def test_split_context_merges_to_the_same_result():
    """Flash-decoding: the context spread over 1, 3 or 8 programs per (row, KV head), with a
    window (leading splits never walked) and sinks (added after the merge)."""
    case = Case([128, 100, 33, 1, None], groups=4, window=70, sinks=True, softcap=10.0)
    whole = case.kernel(splits=1)
    assert_close(whole, case.reference())
    for splits in (3, 8):
        torch.testing.assert_close(case.kernel(splits=splits), whole, atol=1e-6, rtol=1e-6)


def test_query_heads_past_one_programs_tile_split_and_merge_alike():
    """A latent pool whose 80 query heads take three programs' tiles (a 512-wide accumulator
    holds 32 heads), its context split over 3 programs too: each tile's partial states merge to
    the unsplit result."""
    decode, _ = paged_kernel.launch_constants(80, 8, 264, torch.float32, latent=True, split=True, softcap=False, sinks=True)
    assert decode["BLOCK_M"] == 32
    case = Case([128, 61, 1, None], groups=80, kv_heads=1, dk=8, dv=264, latent=True, window=40, sinks=True)
    whole = case.kernel(splits=1)
    assert_close(whole, case.reference())
    torch.testing.assert_close(case.kernel(splits=3), whole, atol=1e-6, rtol=1e-6)


def test_long_row_splits_by_default():
    """A bucket longer than PARTITION positions splits without being asked (one row, one KV
    head: few programs), through the op."""
    max_blocks = paged_kernel.PARTITION // 16 + 4
    assert paged_kernel.split_count(1, 1, max_blocks, 16) == 2
    case = Case([max_blocks * 16 - 5], groups=2, kv_heads=1, dk=16, max_blocks=max_blocks, num_blocks=max_blocks + 4)
    assert_close(torch.ops.kvserve.paged_attention(*case.args()), case.reference())


def test_split_count_follows_static_shapes_only():
    """More splits for a longer bucket, fewer once the rows alone fill the device; never more
    than the bucket has tiles."""
    count = paged_kernel.split_count
    assert count(1, 8, 8, 16) == 1  # 128 positions: one program per row
    assert count(1, 8, 4096, 16) == paged_kernel.TARGET_PROGRAMS // 8  # 64k positions, one row: fill the device
    assert count(1, 8, 2048, 16) == 2048 * 16 // paged_kernel.PARTITION
    assert count(256, 8, 2048, 16) == 1  # 2048 programs already
    assert count(1, 1, 64, 16, partition=1) == 64 * 16 // paged_kernel.BLOCK_N


def test_matches_the_gathered_bucket_path():
    """What the kernel replaces: attention.py's `_attend` over keys gathered by the tables with
    an additive mask (`Batch.prepare`'s), sdpa and the eager formula (softcap, sinks)."""
    case = Case([9, 33, 64, None], groups=4)
    bs = case.block_size
    slots = (case.tables[:, :, None] * bs + torch.arange(bs, device=DEVICE)).flatten(1)
    k_rows, v_rows = (x[:, slots].transpose(0, 1) for x in (case.keys, case.values))  # [B, Hkv, L, D]
    allowed = torch.arange(slots.shape[1], device=DEVICE)[None, :] <= case.positions[:, None]
    mask = additive(allowed, case.q.dtype)[:, None, None, :]
    assert_close(case.kernel(), _attend(case.q, k_rows, v_rows, mask, case.scale, None))
    case.softcap, case.sinks = 6.0, torch.randn(2, 4, device=DEVICE)
    sinks = case.sinks.view(1, 2, 4, 1)
    assert_close(case.kernel(), _attend(case.q, k_rows, v_rows, mask, case.scale, 6.0, sinks))


def test_a_latent_pool_is_read_as_the_gathered_path_meets_it():
    """Over an MLA latent pool the kernel gives what `_attend` gives over the gathered latent
    and rotary keys (`mla.meet` side by side), split over the context or not."""
    case = Case([9, 33, 64, 128, None], groups=8, kv_heads=1, dk=16, dv=48, latent=True)
    bs = case.block_size
    slots = (case.tables[:, :, None] * bs + torch.arange(bs, device=DEVICE)).flatten(1)
    k_rows, v_rows = (x[:, slots].transpose(0, 1) for x in (case.keys, case.values))
    allowed = torch.arange(slots.shape[1], device=DEVICE)[None, :] <= case.positions[:, None]
    want = _attend(case.q, k_rows, v_rows, additive(allowed, case.q.dtype)[:, None, None, :], case.scale, None)
    assert want.shape[-1] == 48
    for splits in (1, 3):
        assert_close(case.kernel(splits=splits), want)
    with pytest.raises(ValueError, match="latent"):  # queries of neither width
        paged_kernel.paged_attention_triton(case.q[..., :40], *case.args()[1:])


# -- rows of several tokens (prefill chunks, forced and drafted tokens) ------------------------------

WIDE = ["gqa2", "gqa7-dk48-dv80", "window", "softcap", "sinks", "block4-all", "chunked", "latent", "latent-many-heads"]


@pytest.mark.parametrize("name", WIDE)
def test_rows_of_several_tokens_match_reference_fp32(name):
    """T = 5 queries a row, each masked to its own position: causal among the row's new
    tokens, windows and chunks moving with each, rows holding fewer than T (padding tokens)."""
    config = CASES[name]
    lengths = LENGTHS if config.get("block_size", 16) == 16 else [1, 4, 5, 14, 32, None]
    case = Case(lengths, width=5, **config)
    assert_close(case.kernel(), case.reference())


@pytest.mark.parametrize("name", ["gqa7-dk48-dv80", "block4-all", "latent"])
def test_rows_of_several_tokens_match_reference_bf16(name):
    config = CASES[name]
    lengths = LENGTHS if config.get("block_size", 16) == 16 else [1, 4, 5, 14, 32, None]
    case = Case(lengths, width=3, dtype=torch.bfloat16, **config)
    assert_close(case.kernel(), case.reference())


def test_a_long_chunk_takes_several_tiles_of_query_rows_and_splits():
    """A 40-token chunk over 2 query heads (80 rows: three tiles of 32 in float32) beside a
    short row, the context split over 1, 2 or 4 programs: every split merges to the whole."""
    case = Case([128, 41, 7, None], groups=2, width=40, window=50, sinks=True, softcap=8.0)
    attend, _ = paged_kernel.launch_constants(80, 32, 32, torch.float32, latent=False, split=True, softcap=True, sinks=True)
    assert attend["BLOCK_M"] == 32
    whole = case.kernel(splits=1)
    assert_close(whole, case.reference())
    for splits in (2, 4):
        torch.testing.assert_close(case.kernel(splits=splits), whole, atol=1e-6, rtol=1e-6)


def test_one_token_a_row_as_a_column_of_positions_is_decode():
    """Positions [B, 1] and positions [B] are the same launch's data: the same result, bit for bit."""
    case = Case(LENGTHS, groups=3, sinks=True, window=20)
    decode = case.kernel()
    case.positions = case.positions[:, None]
    torch.testing.assert_close(case.kernel(), decode, atol=0, rtol=0)


def test_rows_of_several_tokens_match_the_gathered_bucket_path():
    """What the kernel replaces for multi-token rows: `_attend` over keys gathered by the
    tables, under `Batch.prepare`'s mask (each query's positions, a KV head's query heads side
    by side) and `_sink_rows`' sinks; with a reach (a picture's tokens see its last)."""
    from server.engine.attention import _sink_rows
    from server.engine.context import visible

    groups, t = 3, 4
    case = Case([9, 33, 64, None], groups=groups, width=t, window=30, softcap=6.0, sinks=True)
    bs = case.block_size
    slots = (case.tables[:, :, None] * bs + torch.arange(bs, device=DEVICE)).flatten(1)
    k_rows, v_rows = (x[:, slots].transpose(0, 1) for x in (case.keys, case.values))  # [B, Hkv, L, D]
    keys = torch.arange(slots.shape[1], device=DEVICE)[None, None, :]
    sinks = _sink_rows(case.sinks.view(2, groups, 1), t)
    for reach in (None, case.positions.max(1, keepdim=True).values.expand(-1, t)):
        case.reach = reach
        allowed = visible(keys, case.positions[:, :, None], case.window, None if reach is None else reach[:, :, None])
        mask = additive(allowed, case.q.dtype).repeat(1, groups, 1)[:, None]
        want = _attend(case.q, k_rows, v_rows, mask, case.scale, case.softcap, sinks)
        assert_close(case.kernel(), want)
        assert_close(case.reference(), want)


# -- quantized pools: fp8 and int8 codes with a scale a slot ------------------------------------------


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("width", [None, 4], ids=["decode", "rows-of-4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_quantized_pool_is_read_as_its_gather_dequantizes(kv_dtype, width, dtype):
    """The kernel reads an fp8 or int8 pool's codes and scales in place and gives what the
    reference gives over the pool's own gather (`kv.read_vectors`: codes times scales, rounded
    to the compute dtype), with a window, sinks and a split context."""
    case = Case(LENGTHS, groups=3, window=40, sinks=True, dtype=dtype, kv_dtype=kv_dtype, width=width)
    assert case.keys.dtype == kv.kv_format(kv_dtype).storage_dtype(dtype)
    want = case.reference()
    assert_close(case.kernel(), want)
    torch.testing.assert_close(case.kernel(splits=3), case.kernel(splits=1), atol=1e-5, rtol=1e-5)


def test_a_quantized_latent_pool_is_read_in_place():
    """An MLA latent pool in fp8: the latent's codes read once, as key and as value."""
    case = Case([1, 16, 45, 128, None], groups=8, kv_heads=1, dk=16, dv=48, latent=True, kv_dtype="fp8", width=3)
    assert_close(case.kernel(), case.reference())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_e4m3_code_reads_as_the_pool_decodes_it(dtype):
    """One position, so the output is its value exactly: a 256-wide value holding every float8
    e4m3 code (the two NaN codes, which the pool never stores, as zeros) times a scale reads as
    the pool's own decode gives it (`kv.KV_DTYPES["fp8"]`), and as torch's float8 conversion."""
    case = Case([1], groups=2, kv_heads=1, dk=16, dv=256, dtype=dtype, kv_dtype="fp8")
    codes = torch.arange(256, dtype=torch.uint8, device=DEVICE)
    codes[codes & 0x7F == 0x7F] = 0
    case.values[:] = codes
    case.value_scales[:] = 0.375
    got = case.kernel()[0, 0]
    want = kv.kv_format("fp8").decode(codes[None], case.value_scales[0, :1], dtype)[0]
    torch.testing.assert_close(got, want.expand_as(got), atol=0, rtol=0)
    torch.testing.assert_close(want, (codes.view(torch.float8_e4m3fn).float() * 0.375).to(dtype), atol=0, rtol=0)


@pytest.mark.parametrize("width, kv_dtype", [(1, "auto"), (3, "auto"), (3, "fp8")])
def test_the_layer_benchmark_compares_like_with_like(width, kv_dtype):
    """bench/paged_attention.py (the kernel against the gathered way, ready for a GPU) runs a
    decode batch and a multi-token one here, over plain and fp8 pools, and its two ways agree."""
    from bench import paged_attention

    got = paged_attention.measure("tiny", 2, width, 20, DEVICE, torch.float32, reps=1, kv_dtype=kv_dtype)
    assert got["max_diff"] < 1e-5 and got["kernel_us"] > 0 and got["gathered_us"] > 0


def test_op_dispatch(monkeypatch):
    """The op runs the kernel here, and the reference on CPU without the interpreter."""
    case = Case([20, 50], groups=2)
    op = torch.ops.kvserve.paged_attention
    torch.testing.assert_close(op(*case.args()), case.kernel(), atol=0, rtol=0)
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not paged_kernel.runs_triton(DEVICE)
        torch.testing.assert_close(op(*case.args()), case.reference(), atol=0, rtol=0)


def test_opcheck():
    """The op's schema, fake implementation and autograd registration agree with its runs."""
    case = Case([5, 20], groups=2, dk=16, max_blocks=2, sinks=True)
    torch.library.opcheck(torch.ops.kvserve.paged_attention.default, case.args(),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compiles_as_one_opaque_op():
    """torch.compile(fullgraph=True) keeps the op whole: one node in the graph AOT autograd
    hands the backend, traced with the fake implementation's shape.

    NOTE: AOT autograd's graph with eager execution (what inductor receives), not inductor
    itself: inductor's C++ build of even a tiny CPU graph takes ~30 s cold here."""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    case = Case([5, 30, None], groups=2, softcap=5.0)
    bs, scale = case.block_size, case.scale

    def step(q, keys, values, tables, positions):
        out = torch.ops.kvserve.paged_attention(q * 2, keys, values, tables, positions, bs, scale, 5.0, None, None)
        return out.sum(-1)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend=aot_autograd(fw_compiler=capture))
    args = case.args()[:5]
    torch.testing.assert_close(compiled(*args), step(*args))
    (graph,) = graphs
    calls = [n for n in graph.graph.nodes if n.op == "call_function" and n.target is torch.ops.kvserve.paged_attention.default]
    assert len(calls) == 1
    assert math.isclose(calls[0].args[6], scale)


# -- in the model runner: decode rows through the kernel give the gather path's tokens ------------


def paged_steps(model, kernel: bool, kv_dtype: str = "auto"):
    """Greedy steps on the paged path (`attention_kernel=kernel`): three prompts in one step
    (rows of several tokens, padded to the widest), four decode steps (bucket-padded, from the
    persistent buffers: the body a CUDA graph replays), then mixed steps where a decode row runs
    beside a row verifying 3 drafted tokens and a later prompt's chunk of 8. Rows of different
    lengths, one crossing a block boundary while it decodes. -> (tokens, logits of every step)."""
    from server.engine.attention import Row
    from server.engine.model_runner import ModelRunner

    prompts = [list(range(3 + r, 3 + r + n)) for r, n in enumerate((5, 14, 30))]
    late = list(range(40, 61))
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 64, model.dtype, kv_dtype) * 4, model.device, model.dtype, kv_dtype=kv_dtype)
    runner = ModelRunner(model, pool, paged=True, cuda_graphs=False, packed=None, max_rows=4, attention_kernel=kernel)
    assert runner.attention_kernel is kernel
    caches = [pool.allocate(64) for _ in range(4)]
    try:
        logits = runner.forward([Row(c, len(p)) for c, p in zip(caches, prompts)], [t for p in prompts for t in p], [0, 1, 2])
        tokens, steps = [logits.argmax(-1).tolist()], [logits]
        for _ in range(4):
            logits = runner.forward([Row(c, 1) for c in caches[:3]], tokens[-1], [0, 1, 2])
            steps.append(logits)
            tokens.append(logits.argmax(-1).tolist())
        for chunk in range(0, len(late), 8):  # row 0 decodes, row 1 verifies 3 drafts, row 3's prompt goes on
            part = late[chunk : chunk + 8]
            rows = [Row(caches[0], 1), Row(caches[1], 3), Row(caches[3], len(part))]
            logits = runner.forward(rows, [tokens[-1][0], tokens[-1][1], 7, 9, *part], [0, 1, 2], [1, 3, 1])
            steps.append(logits)
            tokens.append(logits.argmax(-1).tolist())
            kv.crop(caches[1], caches[1].length - 2)  # two drafts rejected
        assert runner.paths["paged_attention"] == ("kernel" if kernel else "gather")
        return tokens, torch.cat(steps)
    finally:
        for c in caches:
            kv.free(c)


@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma2", "gpt_oss", "llama4_text", "deepseek_v3"])
def test_the_runner_attends_through_the_kernel_as_through_the_gather(family):
    """The paged path's rows attend through the kernel (`attention_kernel=True`; under the
    interpreter on CPU) and give the gather path's greedy tokens, with logits within float32
    rounding, through prompts, decode steps and mixed steps (`paged_steps`): GQA, sliding
    windows past their length, Gemma 2's soft-capping, gpt-oss's sinks, Llama 4's chunks,
    DeepSeek-V3's MLA latent."""
    from bench import architectures
    from server.engine import mla

    model = architectures.build(family, DEVICE)
    if family == "deepseek_v3":
        assert mla.configure(model, "latent") == "latent" and kv.layout(model.config).latent
    (want, want_logits), (got, got_logits) = (paged_steps(model, kernel) for kernel in (False, True))
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
def test_a_quantized_pool_through_the_kernel_gives_the_gathered_tokens(kv_dtype):
    """An fp8 or int8 pool: the kernel reads its codes and scales in place (by default on a
    GPU, as for plain storage) and the steps give the gather path's greedy tokens, which
    dequantizes the whole bucket first; the logits agree within float32 rounding."""
    from bench import architectures

    model = architectures.build("qwen2", DEVICE)
    (want, want_logits), (got, got_logits) = (paged_steps(model, kernel, kv_dtype) for kernel in (False, True))
    assert got == want
    torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_store_kernel_writes_what_two_index_copies_write(dtype, monkeypatch):
    """`kvserve::store_kv`: a decode step's new keys and values (views into the step's larger
    K/V, as attention hands them over; Dk != Dv, neither a power of two) land at their slots
    of a plain pool exactly as `index_copy_` puts them, and nowhere else; off the kernels (CPU
    without the interpreter) the op is those two copies. Its schema declares what it mutates."""
    gen = torch.Generator().manual_seed(3)
    kv_heads, slots_n, dk, dv, rows = 2, 64, 24, 40, 5
    step_k = torch.randn(kv_heads, rows + 3, dk, generator=gen).to(DEVICE, dtype)
    step_v = torch.randn(kv_heads, rows + 3, dv, generator=gen).to(DEVICE, dtype)
    key, value = step_k[:, :rows], step_v[:, :rows]  # the decode rows come first
    slots = torch.tensor([7, 33, 2, 63, 63], device=DEVICE)  # two padding rows on the trash slot
    keys, values = torch.randn(kv_heads, slots_n, dk, generator=gen).to(DEVICE, dtype), torch.randn(kv_heads, slots_n, dv, generator=gen).to(DEVICE, dtype)
    want_k, want_v = keys.clone().index_copy_(1, slots[:4], key[:, :4]), values.clone().index_copy_(1, slots[:4], value[:, :4])
    got_k, got_v = keys.clone(), values.clone()
    torch.ops.kvserve.store_kv(key, value, got_k, got_v, slots, None, None, "auto")
    assert torch.equal(got_k[:, :63], want_k[:, :63]) and torch.equal(got_v[:, :63], want_v[:, :63])
    assert any(torch.equal(got_k[:, 63], key[:, r]) for r in (3, 4))  # the trash slot holds one of its rows
    torch.library.opcheck(torch.ops.kvserve.store_kv.default, (key, value, keys.clone(), values.clone(), slots, None, None, "auto"),
                          test_utils=("test_schema",))
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not paged_kernel.runs_triton(DEVICE)
        plain_k, plain_v = keys.clone(), values.clone()
        torch.ops.kvserve.store_kv(key[:, :4], value[:, :4], plain_k, plain_v, slots[:4], None, None, "auto")
        assert torch.equal(plain_k, want_k) and torch.equal(plain_v, want_v)


def _edge_vectors(kv_heads: int, width: int, dtype: torch.dtype, gen) -> torch.Tensor:
    """[kv_heads, n, width] vectors that test a quantizer's rounding: random ones of every
    magnitude, an all-zero one, ones whose amax makes an exact scale with every other value a
    tie (x / scale = k + 0.5: int8's half-to-even), ties between float8 e4m3 neighbours, normal
    and subnormal (8.5, 9.5, 1.5 * 2**-9, ...), and negative zeros."""
    n = 64
    x = torch.randn(kv_heads, n, width, generator=gen) * torch.logspace(-6, 4, n)[None, :, None]
    x[:, 0] = 0
    steps = torch.arange(width, dtype=torch.float32) % 120 - 60
    x[:, 1] = (steps + 0.5) * 2.0**-3
    x[:, 1, 0] = 127 * 2.0**-3  # amax / 127 = 2**-3 exactly: every other value a tie for int8
    e4m3_ties = torch.tensor([8.5, 9.5, 17.0, 19.0, 0.0146484375, 1.5 * 2**-9, 2.5 * 2**-9, 448.0, -8.5, -0.0])
    x[:, 2] = e4m3_ties.repeat(width // len(e4m3_ties) + 1)[:width]
    x[:, 2, -1] = 448.0  # amax / 448 = 1: the ties stay ties
    x[:, 3] = -0.0
    return x.to(DEVICE, dtype)


@pytest.mark.parametrize("kv_dtype", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_store_kernel_quantizes_as_the_pool_does_bit_for_bit(kv_dtype, dtype, monkeypatch):
    """`kvserve::store_kv` over an fp8 or int8 pool: one launch quantizes each token's key and
    value (its scale rounded to bf16, the codes rounded to nearest even, int8 half to even)
    into exactly the codes and scales `kv.put_kv` stores, at their slots and nowhere else,
    for vectors of every magnitude, zeros and rounding ties; off the kernels, `put_kv` itself."""
    gen = torch.Generator().manual_seed(5)
    fmt = kv.kv_format(kv_dtype)
    kv_heads, dk, dv, n_slots = 2, 80, 48, 160
    key, value = _edge_vectors(kv_heads, dk, dtype, gen), _edge_vectors(kv_heads, dv, dtype, gen)
    slots = torch.randperm(n_slots, generator=gen)[: key.shape[1]].to(DEVICE)

    def pool():
        return (torch.zeros(kv_heads, n_slots, dk, dtype=fmt.storage, device=DEVICE), torch.zeros(kv_heads, n_slots, dv, dtype=fmt.storage, device=DEVICE),
                torch.zeros(kv_heads, n_slots, dtype=kv.SCALE_DTYPE, device=DEVICE), torch.zeros(kv_heads, n_slots, dtype=kv.SCALE_DTYPE, device=DEVICE))

    want, got = pool(), pool()
    kv.put_kv(fmt, want[0], want[1], want[2], want[3], slots, key, value)
    torch.ops.kvserve.store_kv(key, value, got[0], got[1], slots, got[2], got[3], kv_dtype)
    for a, b in zip(got, want):
        assert torch.equal(a.view(torch.uint8) if a.dtype != kv.SCALE_DTYPE else a.view(torch.int16),
                           b.view(torch.uint8) if b.dtype != kv.SCALE_DTYPE else b.view(torch.int16))
    torch.library.opcheck(torch.ops.kvserve.store_kv.default, (key, value, *pool()[:2], slots, *pool()[2:], kv_dtype),
                          test_utils=("test_schema",))
    if DEVICE.type == "cpu":
        monkeypatch.delenv("TRITON_INTERPRET")
        plain = pool()
        torch.ops.kvserve.store_kv(key, value, plain[0], plain[1], slots, plain[2], plain[3], kv_dtype)
        assert all(torch.equal(a, b) for a, b in zip(plain, want))


# -- built for the GPU: what a program asks of an H200 ---------------------------------------------


def test_the_kernels_fit_an_h200s_shared_memory():
    """The paged attention kernels built ahead of time for sm_90 by Triton's compiler and ptxas
    (no GPU needed: bench/kernel_resources.py) as they launch for a dense model (plain and fp8
    KV) and for DeepSeek-V3's latent (128 query heads on one KV head, 512 wide), in bf16 and float32, over
    decode rows and over a chunk's rows (a tile of query rows as full as it gets): every
    program fits the shared memory one block may have, so none fails at its first launch on
    the card, and in bf16 (what the card serves) none spills registers. One program of all 128
    heads asked 385 KB in float32; 64 heads a program spilled 4 KB a thread in bf16."""
    import json
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia.compiler")
    if not hasattr(pytest.importorskip("triton._C.libtriton"), "native_specialize_impl"):
        pytest.skip("this Triton has no native_specialize_impl (3.4 and later): the bench cannot specialise as its JIT does")
    from bench.kernel_resources import SHARED_LIMIT

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    shapes = ["qwen2.5-32b", "qwen2.5-32b-fp8-kv", "deepseek-v3-latent", "deepseek-v3-latent-fp32"]
    run = subprocess.run([sys.executable, "-m", "bench.kernel_resources", "--json", "--shapes", *shapes], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(run.stdout.strip().splitlines()[-1])
    assert sorted(figures) == sorted(shapes)
    for name, both in figures.items():
        assert sorted(both) == ["chunk", "decode"]
        for rows, got in both.items():
            for kernel in ("attention", "merge", "store"):
                k = got[kernel]
                assert k["registers"] > 0 and k["shared"] <= SHARED_LIMIT, (name, rows, kernel, k)
                assert name.endswith("fp32") or k["spilled"] == 0, (name, rows, kernel, k)
    assert figures["deepseek-v3-latent-fp32"]["decode"]["rows_a_program"] < 128
