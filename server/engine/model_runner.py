"""The model runner: one owner for how a step runs on the device.

It holds the model, the KV pool the model's sequences live in, the persistent input buffers
and, on CUDA, the captured graphs. Each step it prepares the inputs (one host-to-device copy),
replays a graph or runs the model eagerly, and returns logits.

Shapes: the plan's rows are packed into one flattened batch of N tokens (server/engine/attention.py);
`run` returns float32 logits [R, vocab], one row per plan row that `completes` (its last pending
token was computed), in plan order; a row carrying a draft of k tokens (server/engine/speculative.py)
has k + 1 consecutive logits rows instead: at its pending token and at each drafted one.

With `paged` (the default on CUDA) every row takes the paged attention path: decode rows (one
token each) first in the flattened batch, multi-token rows in padded batches. A step of decode
rows alone is padded to a bucket size (`BUCKETS`) whose padding rows write and read the pool's
trash block only, its inputs in persistent buffers; on CUDA it replays the graph captured for
its (bucket, max blocks) pair. Everything else runs eagerly, the same code on CPU and CUDA.
Each step's inputs reach the device in one host-to-device copy.
"""

from __future__ import annotations

import bisect
import functools
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from cache_manager import kv
from server.engine import attention, compiled, context, cpu_linear, differential, faults, lockstep, lora, merged, mla, paged_kernel, recurrent, rope, temperature, vision
from server.engine import exact as exact_mode
from server.engine.context import Batch, Row, StepContext, StepRows
from server.engine.scheduler import Plan, ScheduledRow

log = logging.getLogger(__name__)

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
MIN_GRAPH_BLOCKS = 16  # the smallest block count a graph reads (x BLOCK_SIZE = 256 tokens)
MAX_GRAPH_TOKENS = 1 << 20  # rows x read length of the largest graph (its gather's size)
CHECK_TOKENS = 8  # the prompt of `check`'s scratch sequence
BIAS_SLOTS = 8  # logit bias entries a decode row's inputs carry (a row with more: its step's argmax on the host)


def bucket(n: int, buckets=BUCKETS) -> int:
    """The smallest bucket >= n (n itself past the last)."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else n


def block_bucket(n: int, largest: int) -> int:
    """The power of two >= n blocks a decode graph reads (at least MIN_GRAPH_BLOCKS), capped
    at `largest`."""
    return min(max(MIN_GRAPH_BLOCKS, 1 << (n - 1).bit_length()), largest)


def _inference(method: Callable) -> Callable:
    """`torch.inference_mode()` as a decorator, at no cost where it is on already (the engine's
    thread runs in it: `Engine._loop`); torch's own decorator costs 1.7 us a call."""

    @functools.wraps(method)
    def inside(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return method(*args, **kwargs)
        with torch.inference_mode():
            return method(*args, **kwargs)

    return inside


@dataclass(slots=True)
class StepOutput:
    """What a step computed: float32 `logits` [R, vocab] (`ModelRunner.forward`) and, for a
    step of decode rows alone, `greedy` [R]: each row's argmax after its logit bias, on the
    device (in a captured graph, computed inside it), so that a step whose rows' tokens are
    all chosen on the device costs one device-to-host copy of R ids (server/engine/sampler.py
    `chosen_on_device`); None otherwise, and where a row's bias has more than `BIAS_SLOTS`
    entries."""

    logits: torch.Tensor
    greedy: torch.Tensor | None = None

    def rows(self, keep: list[int]) -> "StepOutput":
        """The output of rows `keep` (indices, in order) alone, without waiting for the device."""
        index = _to_device({"keep": keep}, self.logits.device)["keep"]
        return StepOutput(self.logits[index], None if self.greedy is None else self.greedy[index])


@dataclass(slots=True)
class DecodeInputs:
    """A decode step's inputs: views of one device buffer (`buffer`, which `ModelRunner._write`
    fills with one copy) that a captured graph reads at each replay. `ids` and `positions`
    [1, size] (`tokens`: `ids`' one row); `slots` [size] (where each row's key and value go);
    `tables` [size, blocks]; `states` [size], a hybrid's state slots; `shift` [1, size], the
    rows' rope shifts where pictures move positions (`ModelRunner._shifts`); `adapters` [size],
    the rows' LoRA adapter slots where adapters are served; the rows' logit bias, token ids and
    float32 values [size, BIAS_SLOTS]. None: the model has no such input."""

    buffer: torch.Tensor
    ids: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    tables: torch.Tensor
    states: torch.Tensor | None
    shift: torch.Tensor | None
    adapters: torch.Tensor | None
    bias_ids: torch.Tensor
    bias_values: torch.Tensor


class ModelRunner:
    """Runs `model` over sequences whose KV lives in `pool` (engine thread only, after `prepare`)."""

    def __init__(self, model, pool: kv.Pool, *, max_context: int | None = None, packed: bool | None = True, cuda_graphs: bool = True,
                 max_rows: int = 64, paged: bool | None = None, exact: bool = False, adapters: lora.Adapters | None = None,
                 attention_kernel: bool | None = None, merge: bool = False, compile: str = "off", overlap: bool | None = None,
                 encoder: vision.Encoder | None = None, lockstep: lockstep.Leader | None = None) -> None:
        self.model = model
        # a tensor-parallel model's shard (server/sharding.py: local weights, its collectives in
        # hooks); rank 0's runner sends each forward to the other ranks first (`lockstep`)
        self.shards = getattr(model.config.get_text_config(decoder=True), kv.SHARDS, 1)
        self.lockstep = lockstep
        self.encoder = encoder  # a vision-language model's (server/engine/vision.py): the pictures' rows of a step
        self.pool = pool
        self.adapters = adapters  # LoRA adapters (server/engine/lora.py): each row's slot, 0 the base
        self.device = pool.device
        self.packed = packed  # cpu_linear.pack_model's `packed`; None: the linear layers left as they are
        # merge q/k/v and gate/up (server/engine/merged.py): a serving runner's choice, made after
        # the LoRA adapters were read (they name the layers as the checkpoint has them)
        self.merge = merge
        self.exact = exact  # exact mode (server/engine/exact.py): batch-invariant linear layers and attention
        self.paged = self.device.type == "cuda" if paged is None else paged
        # the paged path's rows (decode rows, prefill chunks, forced and drafted tokens) read the pool
        # in place (server/engine/paged_kernel.py; an fp8 or int8 pool's codes and scales) rather
        # than gathered: by default on CUDA where Triton runs; never in exact mode (its own kernel)
        if attention_kernel is None:
            attention_kernel = self.device.type == "cuda" and paged_kernel.TRITON
        self.attention_kernel = self.paged and attention_kernel and not exact
        # whether `prepare` compiles the decode steps' forward (server/engine/compiled.py): `compile`
        # "require" on any device, "auto" on CUDA, "off" never; the app refuses to start without it
        # under "require"
        self.compile = compile == "require" or (compile == "auto" and self.device.type == "cuda")
        self._compiled: Callable[..., object] | None = None
        # ... and where the steps of more than decode rows run it too (the paged path, once its
        # warm-up compiled them: `_padding_chunk`)
        self._compiled_mixed: Callable[..., object] | None = None
        # whether the engine may launch a decode step before the previous one's tokens reach the
        # host (`run_ahead`); None: on CUDA. `prepare` turns it off where a step cannot be undone.
        self.overlap = self.device.type == "cuda" if overlap is None else overlap
        self.max_rows = bucket(max_rows)
        self.max_blocks = kv.blocks_for(max_context or model_context(model), pool.block_size)
        self.groups = pool.layout.groups  # query heads per KV head
        # NOTE: faults' `capture` switch attempts (and fails) a capture off a GPU too
        self.use_graphs = cuda_graphs and ((self.device.type == "cuda" and self.paged) or faults.switched_on("capture"))
        self.paths: dict[str, str] = {}  # how each fast path runs (`describe_paths`), once prepared
        self.fallbacks: dict[str, str] = {}  # path -> why it runs slower than it should (each logged once)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, StepOutput]] = {}
        # NOTE: transformers builds no mask when handed a 4D one; ours are built per row/batch.
        self._no_mask = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=self.device)
        self._meta: torch.Tensor | None = None  # the decode inputs, one device buffer
        self._views_by_bucket: dict[tuple[int, int], DecodeInputs] = {}  # its views per (rows, blocks) bucket
        self._graph_pool = None
        self._logits: torch.Tensor | None = None  # the decode graphs' shared output [max_rows, vocab]
        self._greedy: torch.Tensor | None = None  # ... and its argmax [max_rows]
        self.rope: rope.LongRope | None = None  # LongRoPE's per-sequence factors (server/engine/rope.py)
        self.observe = None  # StepContext.observe for the eager steps (families.check's probe)
        self._enabled = False

    def prepare(self) -> None:
        """Switch the model to kvserve's attention, pack CPU weights, capture the decode graphs
        (CUDA). On the engine thread: packing runs multi-threaded (cpu_linear.pack_model)."""
        self._enable()
        if self.compile and self._compiled is None:
            self._compile()
        self.paths.setdefault("compile", "off")
        self._decide_overlap()
        if self.use_graphs and not self.graphs:
            self._capture_all()
        self.paths["cuda_graphs"] = (
            "captured" if self.graphs else "eager" if "cuda_graphs" in self.fallbacks else
            "off" if self.device.type == "cuda" and self.paged else "n/a"
        )

    @torch.inference_mode()
    def _compile(self) -> None:
        """Compile the decode forward now (`compiled.decode_forward`), warming it up on padding
        rows at one and two rows (the two compilations dynamo makes) and, on the paged path, on
        a step of two padding tokens (`_padding_chunk`: the steps of more than decode rows, a
        third); a feature that keeps the eager forward, or a failed compilation, logs a fallback
        and leaves the eager one (a failure of the third alone: for those steps only)."""
        why = compiled.why_eager(self)
        if why is None:
            self._compiled = compiled.decode_forward(self.model)

            def decode_steps() -> None:
                for size in (1, 2):
                    inputs, step = self._padding_step(size, block_bucket(1, self.max_blocks))
                    self._forward(inputs.ids, inputs.positions, step, None, self._compiled, shift=inputs.shift)

            why = self._warm_up("the decode forward", decode_steps)
            if why is not None:
                self._compiled = None
        if why is not None:
            self._fall_back("compile", f"{why}; decode steps run the eager forward")
        elif self.paged:  # the steps of more than decode rows too, or they stay eager alone
            failed = self._warm_up("the steps of more than decode rows", lambda: self._forward(*self._padding_chunk(), self._compiled))
            if failed is None:
                self._compiled_mixed = self._compiled
            else:
                self._fall_back("compile_mixed", f"{failed}; they run the eager forward")
        self.paths["compile"] = "eager" if self._compiled is None else "decode+mixed" if self._compiled_mixed is not None else "decode"

    def _warm_up(self, what: str, run: Callable[[], None]) -> str | None:
        """Compile `what` by running it once (`run`, on padding): None where it compiled (logged
        with its time and graphs), else why not. A failure on a tensor-parallel rank ends the
        rank (`_end_the_rank`)."""
        t0, before = time.perf_counter(), compiled.compilations()
        try:
            run()
        except Exception as exc:  # noqa: BLE001 - any failure leaves the eager forward, named by the caller
            log.debug("compiling %s failed", what, exc_info=True)
            self._end_the_rank(f"compiling {what}", "--compile", exc)
            return f"compiling {what} failed ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        log.info("compiled %s in %.1f s (%d graphs)", what, time.perf_counter() - t0, compiled.compilations() - before)
        return None

    def _end_the_rank(self, what: str, switch: str, exc: Exception) -> None:
        """A warm-up (`what`) that failed on a tensor-parallel rank ends the rank, where one
        rank alone would fall back to eager: the other ranks may be waiting inside the same
        compiled or captured collective, so none can go on."""
        if self.shards > 1:
            raise RuntimeError(f"{what} failed on this tensor-parallel rank ({type(exc).__name__}: {exc}); serve with {switch} off") from exc

    def _decide_overlap(self) -> None:
        """Keep `overlap` only where a step launched ahead can be taken back: its rows' KV is
        cropped by one token when their previous token stopped them."""
        if self.overlap:
            why = ("a hybrid's recurrent state moves in place and cannot be cropped" if self.pool.states is not None else
                   "tensor parallel: each step's tokens go to the other ranks from the host" if self.shards > 1 else
                   "LongRoPE picks a row's factors from its host-side length" if self.rope is not None else
                   "decode steps take the eager path (the paged path is off)" if not (self.paged or self._compiled is not None) else None)
            if why is not None:
                self.overlap = False
                self._fall_back("overlap", f"{why}; each step waits for the previous one's tokens")
        self.paths["overlap"] = "on" if self.overlap else "off"

    def _fall_back(self, path: str, reason: str) -> None:
        """Record (and log once, as a WARNING) that `path` runs slower than asked, and why."""
        self.fallbacks[path] = reason
        log.warning("fallback: %s: %s", path, reason)

    def _enable(self) -> None:
        if self._enabled:
            return
        for install in PATCHES:
            self.paths.update(install(self))
        if self.paged or self.compile:
            self._meta = torch.zeros(self.max_rows * (self._per_row + self.max_blocks + 2 * BIAS_SLOTS), dtype=torch.long, device=self.device)
        self._enabled = True

    def _context(self, rows: list[Row], batches: list[Batch], *, long_tokens: torch.Tensor | None = None,
                 adapters: torch.Tensor | None = None, states: StepRows | None = None) -> StepContext:
        """A step's context (server/engine/context.py) with this runner's modes."""
        pool = batches[0].pool if batches else rows[0].kv.pool if rows else self.pool  # rows' caches may be in pools of their own
        return StepContext(rows, batches, self.exact, long_tokens, adapters, states, self.observe, pool=pool)

    # -- a step ------------------------------------------------------------------------------

    def run(self, plan: Plan, ids: torch.Tensor | None = None, pick: list[int | None] | None = None) -> StepOutput:
        """Compute every row's scheduled tokens in one forward pass (`forward`'s logits; a step
        of decode rows alone also gives their argmax on the device). With `ids` (on the device):
        row i's one token is `ids[pick[i]]` where `pick[i]` is not None (`run_ahead`;
        `_device_tokens` puts them in the step).

        Side effect: writes their KV into each sequence's cache (its length moves forward, drafted
        tokens included: postprocess crops the rejected ones).
        """
        rows, token_ids, logits_rows, counts, media = [], [], [], [], []
        for i, row in enumerate(plan.rows):
            drafted = row.draft.tokens if row.draft is not None else []
            rows.append(self._row(row, row.n_tokens + len(drafted)))
            pending = row.seq.pending_ids(row.n_tokens)
            images = row.seq.request.images
            if images and self.encoder is not None:
                media.append(self.encoder.rows(images, row.seq.n_computed, row.n_tokens))
                pending = vision.placeholder_ids(pending, self.encoder.placeholder)
            else:
                media.append([])
            if pick is not None:  # the step's tokens as `_device_tokens` takes them
                pending = [pick[i]] if pick[i] is not None else [-1 - t for t in pending]
            token_ids += pending + drafted
            if row.completes:
                logits_rows.append(i)
                counts.append(1 + len(drafted))
        long_rows = [self.pool.layout.rope_long(len(row.seq.all_ids) + (pick is not None and pick[i] is not None))
                     for i, row in enumerate(plan.rows)] if self.rope else None
        return self._step(rows, token_ids, logits_rows, counts, long_rows, *self._row_inputs(plan), media=media if any(media) else None,
                          device=ids)

    def _row(self, row: ScheduledRow, n: int) -> Row:
        """A scheduled row's part of the step: `n` tokens, and what its pictures do to them
        (server/engine/vision.py): the rope shift they leave, a grid's 3-D positions, how far
        a picture that attends to itself whole sees."""
        images = row.seq.request.images if self.encoder is not None else ()
        if not images:
            return Row(row.seq.cache, n)
        first = row.seq.n_computed
        return Row(row.seq.cache, n, shift=vision.shift(images, first), grid=vision.rope_positions(images, first, n),
                   reach=vision.reach(images, first, n))

    @_inference
    def run_ahead(self, plan: Plan, ids: torch.Tensor, pick: list[int | None]) -> StepOutput:
        """`run` for a step launched before the host has read the previous one's tokens (the
        engine's overlap): row i's one token is `ids[pick[i]]` (`ids`: the previous step's
        tokens chosen on the device), or where `pick[i]` is None, its pending tokens, which
        are on the host (a row of several: `run`'s path for steps of more than decode rows).
        `run`'s side effects."""
        if any(row.n_tokens > 1 for row in plan.rows):
            return self.run(plan, ids, pick)
        self._enable()
        rows = [self._row(row, 1) for row in plan.rows]
        # a token on the host travels as -1 - token (`_device_tokens`)
        tokens = [p if p is not None else -1 - row.seq.pending_ids(1)[0] for p, row in zip(pick, plan.rows)]
        return self._decode(rows, tokens, *self._row_inputs(plan), ids)

    def _row_inputs(self, plan: Plan) -> tuple[list[int] | None, list[dict[int, float]]]:
        """What `run` and `run_ahead` read off each row's sequence alike: its LoRA adapter slot
        (None: no adapters served, or every row on the base model) and its logit bias."""
        return self._adapter_slots([row.seq.adapter_slot for row in plan.rows]), [row.seq.params.logit_bias for row in plan.rows]

    def _adapter_slots(self, slots: list[int] | None) -> list[int] | None:
        """Each row's adapter slot, or None where no adapters are served or every row runs the
        base model (the step then takes the base model's path and graphs)."""
        return slots if self.adapters is not None and slots and any(slots) else None

    def forward(self, rows: list[Row], token_ids: list[int], logits_rows: list[int], logits_counts: list[int] | None = None,
                long_rows: list[bool] | None = None, adapter_rows: list[int] | None = None) -> torch.Tensor:
        """Run the step's tokens through the model; each row's KV is written into its own cache
        and its `length` moves forward. `token_ids`: the rows' new tokens, concatenated in row
        order. Returns float32 logits at the last token of each listed row (by index into
        `rows`): [len(logits_rows), vocab]; with `logits_counts`, at the last `logits_counts[j]`
        tokens of listed row j, in order: [sum(logits_counts), vocab] (speculative decoding
        verifies every drafted position). `long_rows` (LongRoPE models, server/engine/rope.py):
        which rows take the long rope factors (default: a row longer than the switch after
        this step). `adapter_rows`: each row's LoRA adapter slot (server/engine/lora.py; 0 or
        None: the base). Switches the model to kvserve's attention on first use (no graphs:
        `prepare` captures them)."""
        return self._step(rows, token_ids, logits_rows, logits_counts, long_rows, adapter_rows).logits

    @_inference
    def _step(self, rows: list[Row], token_ids: list[int], logits_rows: list[int], logits_counts: list[int] | None,
              long_rows: list[bool] | None, adapter_rows: list[int] | None, biases: list[dict[int, float]] | None = None,
              media: list[list[tuple[int, torch.Tensor]]] | None = None,
              device: torch.Tensor | None = None) -> StepOutput:
        """`forward`, with `biases` (each row's logit bias: a step of decode rows alone takes
        its argmax on the device), `media` (each row's pictures: `run`) and `device` (ids on
        the device that `token_ids` index, as `_device_tokens` takes them: `run`)."""
        self._enable()
        if sum(r.n for r in rows) != len(token_ids):
            raise ValueError(f"{len(token_ids)} tokens for rows of {sum(r.n for r in rows)}")
        counts = logits_counts or [1] * len(logits_rows)
        if len(counts) != len(logits_rows) or any(not 1 <= c <= rows[i].n for i, c in zip(logits_rows, counts)):
            raise ValueError(f"logits counts {counts} do not fit rows {logits_rows}")
        if self.lockstep is not None:  # the other ranks run this forward too, over their shards
            self.lockstep.step(rows, token_ids, logits_rows, logits_counts, long_rows)
        long_tokens = self._long_tokens(rows, long_rows)
        adapter_rows = self._adapter_slots(adapter_rows)
        # NOTE: a hybrid's row at length 0 (a one-token prompt, a first chunk cut to one token)
        # starts from no state: a decode step would continue its slot's last owner's
        fresh_state = self.pool.states is not None and any(r.kv.length == 0 for r in rows)
        if (device is None and media is None and long_tokens is None and not fresh_state and (self.paged or self._compiled is not None)
                and counts == [1] * len(rows)
                and logits_rows == list(range(len(rows))) and all(r.n == 1 for r in rows)):
            return self._decode(rows, token_ids, adapter_rows, biases)
        # decode rows first (the paged path's decode batch), then the others in plan order;
        # logits are kept in plan order
        singles = [i for i, r in enumerate(rows) if r.n == 1] if self.paged else []
        others = [i for i in range(len(rows)) if not (self.paged and rows[i].n == 1)]
        given = [0]
        for row in rows:
            given.append(given[-1] + row.n)
        flat_ids, positions, starts, flat_long, flat_adapters = [], [], [0] * len(rows), [], []
        grids = any(r.grid is not None for r in rows)
        axes: list[list[int]] = [[], [], []]  # M-RoPE's 3-D positions, where a picture's grid is in the step
        for i in singles + others:
            row = rows[i]
            row.offset = starts[i] = len(flat_ids)
            flat_ids += token_ids[given[i] : given[i + 1]]
            mine = range(row.kv.length + row.shift, row.kv.length + row.shift + row.n)
            positions += mine
            if grids:
                for axis, values in zip(axes, row.grid or (mine, mine, mine)):
                    axis += values
            if long_tokens is not None:
                flat_long += [long_tokens[i]] * row.n
            if adapter_rows is not None:
                flat_adapters += [adapter_rows[i]] * row.n
        keep = [starts[i] + rows[i].n - c + j for i, c in zip(logits_rows, counts) for j in range(c)]
        kept = len(keep)
        # a compiled step beside the decode steps' graphs: the paged path's batches alone
        opaque = self._compiled_mixed is not None and media is None and not grids and len(flat_ids) > 1
        if opaque:  # one graph: no 0- or 1-sized input for dynamo to specialise on (the extra logits are dropped)
            keep += [keep[-1] if keep else 0] * max(0, 2 - kept)
        pictured = [starts[i] + offset + j for i, pieces in enumerate(media or ()) for offset, f in pieces for j in range(f.shape[1])]
        groups = [[rows[i] for i in singles]] if singles else []
        if self.paged and others:  # multi-token rows: one padded batch per width bucket
            widths: dict[int, list[Row]] = {}
            for i in others:
                widths.setdefault(_width_bucket(rows[i].n), []).append(rows[i])
            groups += widths.values()
            others = []
        inputs = [self._batch_inputs(group) for group in groups]
        states_in, build_states = self._state_inputs([(r.offset, r.n, r.kv.state, r.kv.length > 0) for r in rows])
        named = {"ids": flat_ids, "positions": positions, "keep": keep, "long": flat_long, "adapters": flat_adapters, "states": states_in,
                 "pictured": pictured, "grid": axes[0] + axes[1] + axes[2]}
        for g, (lists, _) in enumerate(inputs):
            named.update({f"{g}.{name}": values for name, values in lists.items()})
        t = _to_device(named, self.device)
        if device is not None:
            _device_tokens(t["ids"], device)
        batches = [build({name: t[f"{g}.{name}"] for name in lists}) for g, (lists, build) in enumerate(inputs)]
        step = self._context([rows[i] for i in others], batches,
                             long_tokens=t["long"].bool() if long_tokens is not None else None,
                             adapters=t["adapters"] if adapter_rows is not None else None,
                             states=build_states(t["states"]) if build_states is not None else None)
        embeds = None
        if media is not None:  # the pictures' feature rows in place of their placeholders' embeddings
            features = torch.cat([f for pieces in media for _, f in pieces], dim=1)
            embeds = self.encoder.embed(t["ids"][None], t["pictured"], features)
            step.deepstack = self.encoder.deepstack(len(flat_ids), t["pictured"], features)
        pos = t["grid"].view(3, 1, -1) if grids else t["positions"][None]
        step.opaque = opaque
        logits = self._forward(t["ids"][None], pos, step, t["keep"], self._compiled_mixed if opaque else None, embeds=embeds)
        for row in rows:
            row.kv.length += row.n
        return StepOutput(logits if kept == len(keep) else logits[:kept])

    def _state_inputs(self, segments: list[tuple[int, int, int | None, bool]]):
        """A hybrid's recurrent layers' view of the step (`recurrent.step_inputs`): its host
        list and builder; ([], None) for other models."""
        if self.pool.states is None:
            return [], None
        return recurrent.step_inputs(self.pool.states, segments)

    def _long_tokens(self, rows: list[Row], long_rows: list[bool] | None) -> list[bool] | None:
        """Per row, whether its tokens take LongRoPE's long factors where their positions
        alone would not (tokens before the switch of a row longer than it); None when no
        token needs it (and for models without LongRoPE)."""
        if self.rope is None:
            return None
        switch = self.rope.switch
        if long_rows is None:
            long_rows = [r.kv.length + r.n > switch for r in rows]
        flags = [bool(long and r.kv.length < switch) for long, r in zip(long_rows, rows)]
        return flags if any(flags) else None

    def _decode(self, rows: list[Row], token_ids: list[int], adapter_rows: list[int] | None = None,
                biases: list[dict[int, float]] | None = None, device_ids: torch.Tensor | None = None) -> StepOutput:
        """Decode rows only (one token each, logits and their argmax after each row's logit
        bias `biases[i]`): padded to a bucket, from the persistent buffers; a captured graph
        replays where one fits. With `device_ids` (on the device) row i's token is
        `device_ids[token_ids[i]]`, or where `token_ids[i]` < 0, -1 - `token_ids[i]`
        (`_device_tokens`)."""
        n = len(rows)
        size = bucket(n)
        longest = kv.blocks_for(max(r.kv.length for r in rows) + 1, self.pool.block_size)
        blocks = block_bucket(longest, self.max_blocks)
        if size > self.max_rows:
            size, blocks = n, longest
        fits = biases is None or all(len(b) <= BIAS_SLOTS for b in biases)
        inputs = self._write(rows, token_ids, size, blocks, adapter_rows, biases if fits else None)
        if device_ids is not None:  # the tokens where the buffer's one host copy put their indices
            ids = inputs.tokens if n == size else inputs.tokens[:n]
            if min(token_ids) < 0:  # rows of tokens from the host beside them
                _device_tokens(ids, device_ids)
            else:  # (the same with fewer kernels; every row of `device_ids`, in order: no index to take)
                torch.clamp(device_ids if token_ids == list(range(device_ids.shape[0])) else device_ids[ids], min=0, out=ids)
        graph = self.graphs.get((size, blocks))
        if graph is not None:
            graph[0].replay()
            whole = n == size and fits
            out = graph[1] if whole else StepOutput(graph[1].logits[:n], graph[1].greedy[:n] if fits else None)
        else:
            step = self._decode_context(inputs, adapters=bool(adapter_rows))
            logits = self._forward(inputs.ids, inputs.positions, step, None, self._compiled, shift=inputs.shift)[:n]
            biased = _biased(logits, inputs.bias_ids[:n], inputs.bias_values[:n]) if fits and biases and any(biases) else logits
            out = StepOutput(logits, biased.argmax(-1) if fits else None)
        for row in rows:
            row.kv.length += 1
        return out

    @property
    def _per_row(self) -> int:
        """Persistent decode inputs per row besides its block table: token, position, slot (and
        a hybrid's state slot, a rope shift where pictures move positions, and a LoRA adapter
        slot where adapters are served)."""
        return 3 + (self.pool.states is not None) + self._shifts + (self.adapters is not None)

    @property
    def _shifts(self) -> bool:
        """Whether a row's rope positions may run apart from its KV positions (an M-RoPE
        vision-language model fed pictures: server/engine/vision.py)."""
        return self.encoder is not None and self.encoder.shifts

    def _write(self, rows: list[Row], token_ids: list[int], size: int, blocks: int, adapter_rows: list[int] | None = None,
               biases: list[dict[int, float]] | None = None) -> DecodeInputs:
        """The decode inputs of `rows` into the persistent device buffer with ONE host-to-device
        copy; returns the buffer's views (`DecodeInputs`). Each row's logit bias is padded to
        BIAS_SLOTS with token 0 and 0.0, which adds nothing. Padding rows: token 0 at position 0,
        writing and reading the trash block only (a hybrid's trash state slot, the base)."""
        positions, slots, tables = paged_inputs(self.pool, [r.kv for r in rows], [1] * len(rows), size, 1, blocks)
        states, pad = self.pool.states, size - len(rows)
        extra = [r.kv.state for r in rows] + [states.trash] * pad if states is not None else []
        if self._shifts:
            extra += [r.shift for r in rows] + [0] * pad
        if self.adapters is not None:
            extra += (adapter_rows or [0] * len(rows)) + [0] * pad
        if biases and any(biases):
            bias_ids, bias_bits = [], []
            for bias in biases + [{}] * (size - len(biases)):
                bias_ids += list(bias) + [0] * (BIAS_SLOTS - len(bias))
                # a float32's bits (as the bias op rounds a value): the buffer holds longs
                bias_bits += [struct.unpack("<i", struct.pack("<f", v))[0] for v in bias.values()] + [0] * (BIAS_SLOTS - len(bias))
            bias_part = bias_ids + bias_bits
        else:
            bias_part = [0] * (2 * size * BIAS_SLOTS)
        inputs = self._inputs(size, blocks)
        inputs.buffer.copy_(_host_longs([token_ids + [0] * pad + positions + slots + extra, tables, bias_part], self.device), non_blocking=True)
        return inputs

    def _inputs(self, size: int, blocks: int) -> DecodeInputs:
        """The views of (size, blocks)'s decode inputs, made once per bucket over the persistent
        buffer (a step past the largest bucket: over a buffer of its own, eager only)."""
        inputs = self._views_by_bucket.get((size, blocks))
        if inputs is not None:
            return inputs
        need = size * (self._per_row + blocks + 2 * BIAS_SLOTS)
        if self._meta is None or self._meta.numel() < need:
            return self._views(torch.empty(need, dtype=torch.long, device=self.device), size, blocks)
        inputs = self._views_by_bucket[(size, blocks)] = self._views(self._meta[:need], size, blocks)
        return inputs

    def _views(self, meta: torch.Tensor, size: int, blocks: int) -> DecodeInputs:
        """`meta`'s layout: per row its token, position and slot (then a hybrid's state slot, a
        rope shift, a LoRA adapter slot: `_per_row`), the block tables, the bias ids and the
        bias values (a float32's bits in each long)."""
        per_row = self._per_row
        ids, pos, slots_t = (meta[i * size : (i + 1) * size] for i in range(3))
        at = 3 * size
        states_t = meta[at : at + size] if self.pool.states is not None else None
        at += size * (states_t is not None)
        shift_t = meta[at : at + size][None] if self._shifts else None
        adapters_t = meta[(per_row - 1) * size : per_row * size] if self.adapters is not None else None
        tables_t = meta[per_row * size : size * (per_row + blocks)].view(size, blocks)
        at = size * (per_row + blocks)
        bias_t = meta[at : at + size * BIAS_SLOTS].view(size, BIAS_SLOTS)
        # NOTE: a view, not a kernel: the low 32 bits of each long (little-endian) as float32
        values_t = meta[at + size * BIAS_SLOTS : at + 2 * size * BIAS_SLOTS].view(torch.int32)[0::2].view(size, BIAS_SLOTS).view(torch.float32)
        return DecodeInputs(meta, ids[None], ids, pos[None], slots_t, tables_t, states_t, shift_t, adapters_t, bias_t, values_t)

    def _decode_context(self, inputs: DecodeInputs, adapters: bool) -> StepContext:
        """A decode step's context over its inputs: its batch, the recurrent layers' rows, the
        rows' adapter slots where `adapters` (some row has one, or a graph is captured)."""
        batch = Batch(self.pool, inputs.slots, inputs.tables, inputs.positions[0], kernel=self.attention_kernel)
        states = recurrent.decode_rows(self.pool.states, inputs.states) if inputs.states is not None else None
        return self._context([], [batch], adapters=inputs.adapters if adapters else None, states=states)

    def _padding_step(self, size: int, blocks: int) -> tuple[DecodeInputs, StepContext]:
        """A decode step of `size` padding rows, every input in the graph (compilation's warm-up
        and graph capture)."""
        inputs = self._write([], [], size, blocks)
        return inputs, self._decode_context(inputs, adapters=True)

    def _padding_chunk(self) -> tuple[torch.Tensor, torch.Tensor, StepContext, torch.Tensor]:
        """The ids, positions, context and kept positions of a step of two padding tokens in
        one row, through the paged path's batches in one opaque op (`StepContext.opaque`): the
        compiled forward's warm-up for steps of more than decode rows. It writes the trash
        block only."""
        cache = kv.SequenceKV(self.pool)
        cache._set_blocks([self.pool.trash_block])
        lists, build = self._batch_inputs([Row(cache, 2)])
        step = self._context([], [build(_to_device(lists, self.device))])
        step.opaque = True
        zeros = torch.zeros(1, 2, dtype=torch.long, device=self.device)
        return zeros, step.batches[0].positions[None], step, torch.ones(2, dtype=torch.long, device=self.device)

    def _batch_inputs(self, rows: list[Row]) -> tuple[dict[str, list[int]], Callable[[dict[str, torch.Tensor]], Batch]]:
        """The paged path's inputs for rows of a mixed step (eager, not padded to a bucket;
        their ids and positions travel with the step's other tokens): named host lists, and
        how to build the `Batch` from them once on the device. Decode rows (one token each)
        come first in the flattened batch; multi-token rows are padded to the widest."""
        counts = [r.n for r in rows]
        size, width = len(rows), max(counts)
        blocks = max(kv.blocks_for(r.kv.length + r.n, self.pool.block_size) for r in rows)
        positions, slots, tables = paged_inputs(self.pool, [r.kv for r in rows], counts, size, width, blocks)
        lists = {"positions": positions, "slots": slots, "tables": tables}
        if width == 1 and all(r.offset == i for i, r in enumerate(rows)):
            return lists, lambda t: Batch(self.pool, t["slots"], t["tables"].view(size, blocks), t["positions"], kernel=self.attention_kernel)
        lists["tokens"] = [r.offset + min(t, r.n - 1) for r in rows for t in range(width)]
        lists["real"] = [i * width + t for i, r in enumerate(rows) for t in range(r.n)]
        every = len(lists["real"]) == len(lists["tokens"])
        if any(r.reach is not None for r in rows):  # a picture that attends to itself whole (padding: as positions)
            lists["reach"] = [r.reach[min(t, r.n - 1)] if r.reach is not None else p
                              for r, chunk in zip(rows, _chunks(positions, width)) for t, p in enumerate(chunk)]
        return lists, lambda t: Batch(self.pool, t["slots"], t["tables"].view(size, blocks), t["positions"], width, t["tokens"],
                                      None if every else t["real"], self.attention_kernel, t.get("reach"))

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, step: StepContext, keep: torch.Tensor | None,
                 model: Callable[..., object] | None = None, embeds: torch.Tensor | None = None,
                 shift: torch.Tensor | None = None) -> torch.Tensor:
        """One forward of `model` (default: the eager one) over the flattened tokens as `step`
        (or over `embeds` [1, N, hidden], their input embeddings, where pictures are in the
        step); float32 logits at `keep` (all: None). The rope positions are `pos` ([1, N], or
        [3, 1, N] for M-RoPE's pictures), plus `shift` [1, N] (decode rows' shifts, added here
        so that a captured graph adds them). The one place a step's context is entered: eager
        steps, compiled decode steps and graph capture all run it."""
        if shift is not None:
            pos = pos + shift
        step.positions = pos if pos.dim() == 2 else None
        for batch in step.batches:
            batch.prepare(self.pool.dtype, self.groups)
        tokens = {"input_ids": ids} if embeds is None else {"inputs_embeds": embeds}
        with context.entered(step):
            out = (self.model if model is None else model)(
                **tokens,
                attention_mask=self._no_mask,  # 4D: transformers' mask building steps aside
                position_ids=pos,
                use_cache=False,
                logits_to_keep=0 if keep is None else keep,
            )
        return out.logits[0].float()

    def to_host(self, ids: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start copying `ids` (on the device) to the host now, without waiting: what is
        launched next may overwrite them. The returned call waits for the copy alone (not for
        later steps) and gives the host tensor."""
        if self.device.type != "cuda":
            host = ids.clone()
            return lambda: host
        host = ids.to("cpu", non_blocking=True)  # into pinned memory
        copied = torch.cuda.Event()
        copied.record(torch.cuda.current_stream(ids.device))  # the copy's stream, whatever device is current

        def wait() -> torch.Tensor:
            copied.synchronize()
            return host

        return wait

    def synchronize(self) -> None:
        """Wait for the device to finish what was launched (on CUDA `run` returns once the
        step's kernels are queued)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def release(self) -> None:
        """Drop the decode graphs, the compiled forward and the buffers they read and write (at
        shutdown, once no step runs; with the pool's storage: `kv.Pool.release`), so that a model
        started next in the same process measures its own budget. A step after it runs eagerly."""
        self._drop_graphs()
        self._compiled = self._compiled_mixed = self._meta = None
        self._views_by_bucket.clear()
        self.release_memory()

    def _drop_graphs(self) -> None:
        """No decode graphs from here on (their memory pool and shared outputs go with them):
        decode steps run without them."""
        self.graphs.clear()
        self.use_graphs = False
        self._graph_pool = self._logits = self._greedy = None

    def release_memory(self) -> None:
        """After an out-of-memory step: hand the allocator's cached blocks back (CUDA), so the
        smaller retry has them."""
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def check(self) -> None:
        """One real prefill and one decode step of a scratch sequence on the paths requests take
        (the decode step replays a captured graph where there is one); raises when either
        fails or gives logits that are not finite. Takes a block of the pool while it runs
        (kv.NoBlocks when it has none)."""
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        ids = [t % vocab for t in range(1, CHECK_TOKENS + 1)]
        cache = self.pool.allocate(CHECK_TOKENS + 1)
        try:
            logits = _finite(self.forward([Row(cache, len(ids))], ids, [0]), "prefill")
            _finite(self.forward([Row(cache, 1)], [int(logits[0].argmax())], [0]), "decode")
        finally:
            kv.free(cache)

    # -- CUDA graphs ---------------------------------------------------------------------------

    def _capture_all(self) -> None:
        """Capture one decode graph per (rows bucket, blocks bucket), largest first so the
        smaller ones reuse its memory. A failure logs and leaves eager decoding."""
        t0 = time.perf_counter()
        block_buckets, b = [], MIN_GRAPH_BLOCKS
        while True:
            block_buckets.append(min(b, self.max_blocks))
            if b >= self.max_blocks:
                break
            b *= 2
        pairs = [(s, nb) for s in BUCKETS if s <= self.max_rows for nb in block_buckets if s * nb * self.pool.block_size <= MAX_GRAPH_TOKENS]
        try:
            if faults.switched_on("capture"):
                raise faults.InjectedFault("injected: graph capture fails")
            free_before = torch.cuda.mem_get_info(self.device)[0]
            self._graph_pool = torch.cuda.graph_pool_handle()
            for size, blocks in sorted(pairs, reverse=True):
                self.graphs[(size, blocks)] = self._capture(size, blocks)
        except Exception as exc:
            log.debug("capturing CUDA graphs failed", exc_info=True)
            self._end_the_rank("capturing the decode graphs", "--cuda-graphs", exc)
            self._fall_back("cuda_graphs", f"capturing the decode graphs failed ({type(exc).__name__}: {exc}); "
                            "decode steps run eagerly, several times slower on a GPU")
            self._drop_graphs()
            return
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info("captured %d decode graphs in %.1f s (%.0f MiB)", len(self.graphs), time.perf_counter() - t0, used / 2**20)

    @torch.inference_mode()
    def _capture(self, size: int, blocks: int) -> tuple[torch.cuda.CUDAGraph, StepOutput]:
        """One decode graph over the persistent buffers of (size, blocks); the buffers hold
        padding rows while capturing (they write the trash block only)."""
        # every row a padding row; a hybrid's state reads and writes, and the LoRA deltas of each
        # row's adapter slot, are in the graph too
        inputs, step = self._padding_step(size, blocks)
        warm = self._forward(inputs.ids, inputs.positions, step, None, self._compiled, shift=inputs.shift)  # warm up outside the graph
        if self._logits is None:  # every graph's output, so none holds logits of its own
            self._logits = torch.empty(self.max_rows, warm.shape[-1], dtype=warm.dtype, device=self.device)
            self._greedy = torch.empty(self.max_rows, dtype=torch.long, device=self.device)
        del warm
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self._logits[:size].copy_(self._forward(inputs.ids, inputs.positions, step, None, self._compiled, shift=inputs.shift))
            torch.argmax(_biased(self._logits[:size], inputs.bias_ids, inputs.bias_values), dim=-1, out=self._greedy[:size])
        return graph, StepOutput(self._logits[:size], self._greedy[:size])


# -- the layer patches ----------------------------------------------------------------------
# Each installs one kind of replaced forward on the runner's model (once; later calls find it
# installed) and returns the engine's paths it decides (`describe_paths`). Every patch reads the
# step from its context (server/engine/context.py). The order matters where one wraps another:
# projections are merged before the linear layers are packed (CPU), which is before exact mode
# routes them and before the LoRA wrappers call them.


def _attention(runner: ModelRunner) -> dict[str, str]:
    attention.enable(runner.model)
    paged = "kernel" if runner.attention_kernel else "gather" if runner.paged else "n/a"
    return {"attention": "paged" if runner.paged else "rows", "paged_attention": paged}


def _differential(runner: ModelRunner) -> dict[str, str]:
    if not differential.enable(runner.model):
        return {}
    return {"differential": "one call"}


def _temperature(runner: ModelRunner) -> dict[str, str]:
    """Llama 4's NoPE layers: the query temperature from each token's position."""
    if not temperature.enable(runner.model):
        return {}
    return {"temperature": "by position"}


def _mla(runner: ModelRunner) -> dict[str, str]:
    if not mla.enable(runner.model):
        return {}
    return {"mla": "latent" if runner.pool.layout.latent else "heads"}


def _recurrent(runner: ModelRunner) -> dict[str, str]:
    if runner.pool.states is None:
        return {}
    return {"recurrent": f"{recurrent.enable(runner.model)} layers, state slots"}


def _rope(runner: ModelRunner) -> dict[str, str]:
    runner.rope = rope.install(runner.model, runner.pool.layout.rope_switch)
    return {}


def _merge(runner: ModelRunner) -> dict[str, str]:
    if not runner.merge:
        return {"merged": "off"}
    # NOTE: a LoRA adapter's targets stay apart (with run-time loading: every linear layer)
    skip = runner.adapters.modules if runner.adapters is not None and runner.adapters.modules else frozenset()
    return {"merged": merged.merge(runner.model, skip=skip).describe()}


def _experts(runner: ModelRunner) -> dict[str, str]:
    """MoE experts run as transformers' experts implementation has them: its default,
    grouped_mm, reads no routing result on the host, so a captured decode step holds them (on
    "eager" it loops over the experts hit, and graph capture falls back, naming why)."""
    layers = sum(type(m).__name__.endswith("Experts") for m in runner.model.modules())
    if not layers:
        return {}
    return {"experts": f"{runner.model.config._experts_implementation}, {layers} layers"}


def _linear(runner: ModelRunner) -> dict[str, str]:
    path = "n/a" if runner.device.type != "cpu" else "off"
    if runner.packed is not None:
        packed, transposed = cpu_linear.pack_model(runner.model, runner.packed)
        if runner.device.type == "cpu":
            path = "packed" if runner.packed and not transposed else "transposed" if not packed else "partly packed"
        if runner.packed and transposed:
            runner._fall_back("cpu_linear", f"{transposed} of {packed + transposed} linear layers cannot be packed "
                              "for oneDNN by this torch build or dtype; they run the slower transposed product")
    return {"cpu_linear": path}


def _exact(runner: ModelRunner) -> dict[str, str]:
    if not runner.exact:
        return {"exact": "off"}
    exact_mode.pin_backends(runner.device, runner.pool.dtype)
    exact_mode.enable(runner.model)
    if runner.device.type == "cuda" and runner.device.type not in exact_mode.KERNELS:
        runner._fall_back("exact", "the Triton kernels are unusable here (the log above says why); "
                          "exact mode runs the torch formulation, slower")
    return {"exact": "kernels" if runner.device.type in exact_mode.KERNELS else "torch"}


def _lora(runner: ModelRunner) -> dict[str, str]:
    if runner.adapters is None:
        return {}
    runner.adapters.attach()  # after packing: the adapters' wrappers run the packed layers
    return {"lora": f"{len(runner.adapters.slots)} slots of rank {runner.adapters.rank}"}


def paged_inputs(pool: kv.Pool, caches: list[kv.SequenceKV], counts: list[int], size: int, width: int,
                 blocks: int) -> tuple[list[int], list[int], np.ndarray]:
    """Positions and slots [size * width], flat, and block tables [size, blocks] of `counts[i]`
    new tokens for each cache of `pool`, padded to `width` tokens a row and `size` rows. A
    padding token repeats its row's last position and writes the trash block; a padding row is
    one token at position 0 with a table of trash blocks. The tables are copied from each
    cache's array (`SequenceKV.table`): their cost is a memory copy, not a Python int each."""
    bs, trash = pool.block_size, pool.trash_block
    positions, slots = [], []
    tables = np.empty((size, blocks), dtype=np.int64)
    tables.fill(trash)
    for i, (cache, n) in enumerate(zip(caches, counts)):
        first = cache.length
        for t in range(width):
            p = first + min(t, n - 1)
            positions.append(p)
            slots.append(cache.blocks[p // bs] * bs + p % bs if t < n else trash * bs)
        table = cache.table[:blocks]
        tables[i, : len(table)] = table
    pad = size - len(caches)
    return positions + [0] * (pad * width), slots + [trash * bs] * (pad * width), tables


def _chunks(values: list[int], width: int) -> list[list[int]]:
    """`values` in consecutive pieces of `width`."""
    return [values[i : i + width] for i in range(0, len(values), width)]


def _deepstack(runner: ModelRunner) -> dict[str, str]:
    """Qwen3-VL's deepstack: the step's picture features reach its first text layers."""
    if runner.encoder is None or not vision.install_deepstack(runner.model):
        return {}
    return {"deepstack": "on"}


PATCHES: tuple[Callable[[ModelRunner], dict[str, str]], ...] = (_attention, _differential, _temperature, _mla, _recurrent, _rope, _deepstack, _experts, _merge, _linear, _exact, _lora)


def _biased(logits: torch.Tensor, ids: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Logits [R, vocab] plus each row's logit bias (token ids and values [R, BIAS_SLOTS]): a
    new tensor (the logits stay the model's, for logprobs), as `sampling.apply_logit_bias`
    adds it."""
    return logits.scatter_add(1, ids, values)


def _device_tokens(ids: torch.Tensor, device_ids: torch.Tensor) -> None:
    """Tokens still on the device into a step's `ids`, in place: where `ids` holds i >= 0 the
    token is `device_ids[i]`, and where it holds -1 - t, a token from the host, t.

    NOTE: a row that drew from no distribution (-1: `sampling.draw_ids`) fails when its token
    reaches the host; until then it computes token 0's step, which the engine drops."""
    ids.copy_(torch.where(ids >= 0, device_ids[ids.clamp(min=0)].clamp(min=0), -1 - ids))


def _finite(logits: torch.Tensor, what: str) -> torch.Tensor:
    if not bool(torch.isfinite(logits).all()):
        raise FloatingPointError(f"the model's {what} logits are not finite (NaN or inf)")
    return logits


def _width_bucket(n: int) -> int:
    """The paged batch a multi-token row joins: rows of n tokens up to the next power of two
    share one (the padding is at most the row's own size)."""
    return 1 << (n - 1).bit_length()


def _host_longs(parts: list[list[int] | np.ndarray], device: torch.device) -> torch.Tensor:
    """The ints of `parts` (lists, and arrays such as a step's block tables), one after the
    other, as one host long tensor to copy to `device` (pinned for a copy to a GPU that does
    not wait). numpy reads the lists: 3-4x faster than `torch.tensor` of them (a step's inputs
    are ~80 ints at 1 row, ~2,300 at 64 besides the tables)."""
    sizes = [_count(part) for part in parts]
    flat, at = np.empty(sum(sizes), dtype=np.int64), 0
    for part, n in zip(parts, sizes):
        flat[at : at + n] = part.reshape(-1) if isinstance(part, np.ndarray) else part
        at += n
    host = torch.from_numpy(flat)
    return host.pin_memory() if device.type == "cuda" else host


def _to_device(named: dict[str, list[int] | np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Long tensors of each named list (or array, flattened) on `device`, with one
    host-to-device copy."""
    flat = _host_longs(list(named.values()), device).to(device, non_blocking=True)
    out, at = {}, 0
    for name, values in named.items():
        out[name] = flat[at : at + _count(values)]
        at += _count(values)
    return out


def _count(part: list[int] | np.ndarray) -> int:
    return part.size if isinstance(part, np.ndarray) else len(part)


def forward_rows(model, rows: list[Row], token_ids: list[int], logits_rows: list[int], logits_counts: list[int] | None = None) -> torch.Tensor:
    """`ModelRunner.forward` outside the engine (tests, benchmarks): the rows' caches may
    live in pools of their own (the row path)."""
    return ModelRunner(model, rows[0].kv.pool, cuda_graphs=False, paged=False).forward(rows, token_ids, logits_rows, logits_counts)


def forward(model, cache: kv.SequenceKV, token_ids: list[int], start: int) -> torch.Tensor:
    """One sequence alone: `token_ids` at positions start.. (= the cache's length), written into
    `cache`; float32 logits [vocab] at the last one."""
    if start != kv.length(cache):
        raise ValueError(f"the cache holds {kv.length(cache)} tokens, not {start}")
    return forward_rows(model, [Row(cache, len(token_ids))], token_ids, [0])[0]


def model_context(model) -> int:
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", 0) or 8192)
