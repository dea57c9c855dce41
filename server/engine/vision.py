"""Images in a prompt: each picture is a run of placeholder tokens whose input embeddings are the
vision encoder's features for it (transformers' `get_image_features`, the projector included),
computed when a step first computes one of its positions.

A picture's run is keyed in the sequence's token ids by `key_ids`: negative ids that carry its
content digest, so everything that compares tokens (session and anonymous reuse, the tiers, a
restart's files) compares pictures by content. Two conversations with the same text and
different pictures never share KV; the same picture at the same place is reused. The model
never sees those ids: `Encoder.embed` gives each such position its feature row instead.

Where a family's rotary positions are 3-D (M-RoPE: the Qwen families), a picture's positions
are its grid's (time, row, column) from the position where it starts, and the text after it
goes on from there, not from its index: the sequence's rope positions run `shift` ahead of (or
behind) its KV index. `Encoder.span` asks the model's own `get_rope_index` for a picture's
grid offsets and advance once, when its span is built; the runner adds each row's shift
(`shift`) and writes a picture's 3-D positions (`rope_positions`).

    features: [1 + deepstack layers, run length, hidden] per picture (the encoder's output, in
              the model's dtype; Qwen3-VL's deepstack layers after the input rows)
    embeds:   [1, step tokens, hidden] (the step's flattened tokens, pictures' rows replaced)

Qwen3-VL also adds encoder features to the output of its first text layers at the pictures'
positions (deepstack): `install_deepstack` hands the step's rows (`StepContext.deepstack`) to
its language model, which adds them as transformers' own forward does.

Gemma 3's picture attends to itself whole (bidirectional attention over its placeholder run;
the text stays causal): a `whole` picture is computed in one pass (`fit` ends a prefill chunk
outside it), and each of its tokens sees up to the run's last position (`reach`, which the
attention's masks take: `context.visible`).
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from server.engine import context

DIGEST_CHUNKS = 4  # 63 bits of the 256-bit digest per position; four positions carry all of it
# The families whose images are fed here, each checked against transformers' `generate`
# (tests/server/test_vision.py). Another vision-language family is served as text, where
# transformers builds it as a causal LM, or not at all.
FAMILIES = frozenset({"llava", "idefics3", "smolvlm", "gemma3", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5",
                      "qwen3_5_moe"})
WHOLE = frozenset({"gemma3"})  # families whose picture attends to itself whole (transformers' token_type_ids blocks)


def key_ids(digest: str, length: int) -> list[int]:
    """The ids a picture's run of `length` placeholders is keyed by: position k carries the
    digest's chunk k mod 4 (63 bits each) as a negative number, never a vocabulary id."""
    chunks = [int(digest[16 * i : 16 * (i + 1)], 16) >> 1 for i in range(DIGEST_CHUNKS)]
    return [-1 - chunks[k % DIGEST_CHUNKS] for k in range(length)]


@dataclass(frozen=True)
class ImageSpan:
    """One picture of a prompt: its placeholder positions as runs (start, length), in order (one
    run, or one per tile where the family writes tile markers between them: Idefics3), its
    `digest` (the picture's content and the processor's settings; `key_ids`) and the processor's
    tensors for it alone (`pixel_values` and whatever else the family's encoder takes). The
    encoder's feature rows follow the runs' positions in order.

    `grid` (M-RoPE families, `Encoder.span`): each placeholder's rotary position [3, length]
    (time, row, column) from the picture's first, and `advance`, how far the picture moves
    the next text position; None and the length elsewhere. `whole`: each run attends to
    itself whole (Gemma 3: `WHOLE`), so it is computed in one pass."""

    runs: tuple[tuple[int, int], ...]
    digest: str
    inputs: Mapping[str, torch.Tensor]
    grid: torch.Tensor | None = None
    advance: int | None = None
    whole: bool = False

    @property
    def length(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def start(self) -> int:
        return self.runs[0][0]

    @property
    def end(self) -> int:
        return self.runs[-1][0] + self.runs[-1][1]

    @property
    def shift(self) -> int:
        """How far the picture moves the rope positions after it from their KV index."""
        return 0 if self.advance is None else self.advance - self.length


class Encoder:
    """The model's vision encoder and projector, with a cache of features by digest: least
    recently used first out once they pass `budget_bytes` (a picture seen again without its KV
    skips the encoder). Thread-safe; the engine thread calls it during a step."""

    def __init__(self, model, budget_bytes: int = 256 * 2**20, metrics=None) -> None:
        base = model.base_model
        self._encode: Callable[..., object] = base.get_image_features
        self._takes = frozenset(inspect.signature(self._encode).parameters) - {"kwargs"}
        self.device = model.device
        self.dtype = model.get_input_embeddings().weight.dtype
        self.budget_bytes = budget_bytes
        self.metrics = metrics
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()
        self.nbytes = 0
        self._embed = model.get_input_embeddings()
        self.placeholder: int = image_token_id(model.config)
        self._rope_index: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = getattr(base, "get_rope_index", None)
        self.shifts = self._rope_index is not None  # whether pictures move the rope positions after them (M-RoPE)
        self.whole = model.config.model_type in WHOLE  # whether a picture attends to itself whole

    def span(self, runs: tuple[tuple[int, int], ...], digest: str, inputs: Mapping[str, torch.Tensor]) -> ImageSpan:
        """The `ImageSpan` of a picture at `runs`, as this model takes it: where its positions
        are 3-D, its grid and advance (the model's `get_rope_index` over the picture followed
        by one text token), and whether it attends to itself whole (`WHOLE`)."""
        length = sum(n for _, n in runs)
        if self._rope_index is None:
            return ImageSpan(runs, digest, inputs, whole=self.whole)
        ids = torch.full((1, length + 1), self.placeholder, dtype=torch.long)
        kinds = torch.ones_like(ids, dtype=torch.int)
        ids[0, -1], kinds[0, -1] = 0, 0  # the text token after the picture: where the next position lands
        positions, _ = self._rope_index(ids, mm_token_type_ids=kinds, image_grid_thw=inputs["image_grid_thw"].cpu())
        return ImageSpan(runs, digest, inputs, positions[:, 0, :length].clone(), int(positions[0, 0, length]), self.whole)

    def features(self, span: ImageSpan) -> torch.Tensor:
        """[1 + deepstack layers, span.length, hidden] on the model's device: cached, or
        encoded now."""
        with self._lock:
            cached = self._cache.get(span.digest)
            if cached is not None:
                self._cache.move_to_end(span.digest)
        if self.metrics is not None:
            self.metrics.encoder_cache_lookups.labels("hit" if cached is not None else "miss").inc()
        if cached is not None:
            return cached
        t0 = time.perf_counter()
        inputs = {k: v.to(self.device) for k, v in span.inputs.items() if k in self._takes}
        with torch.inference_mode():
            out = self._encode(**inputs, return_dict=True)
        layers = [out.pooler_output, *(getattr(out, "deepstack_features", None) or ())]
        features = torch.stack([_rows(layer) for layer in layers])
        if features.shape[1] != span.length:
            raise ValueError(f"the encoder gave {features.shape[1]} feature rows for a picture of {span.length} placeholders")
        features = features.to(self.dtype)
        if self.metrics is not None:
            self.metrics.encoder_seconds.observe(time.perf_counter() - t0)
        self._keep(span.digest, features)
        return features

    def _keep(self, digest: str, features: torch.Tensor) -> None:
        nbytes = features.numel() * features.element_size()
        if nbytes > self.budget_bytes:
            return
        with self._lock:
            if digest in self._cache:
                return
            self._cache[digest] = features
            self.nbytes += nbytes
            while self.nbytes > self.budget_bytes:
                _, old = self._cache.popitem(last=False)
                self.nbytes -= old.numel() * old.element_size()
        if self.metrics is not None:
            self.metrics.encoder_cache_bytes.set(self.nbytes)

    def rows(self, spans: Sequence[ImageSpan], first: int, n: int) -> list[tuple[int, torch.Tensor]]:
        """The feature rows a row computing positions [first, first + n) needs: (offset in the
        row's tokens, features [1 + deepstack layers, m, hidden]) per run it touches."""
        out = []
        for span in spans:
            if span.end <= first or span.start >= first + n:
                continue
            features = self.features(span)  # once for all its runs: one lookup, at most one encoding
            row = 0  # the span's feature row at the run's start
            for start, length in span.runs:
                lo, hi = max(start, first), min(start + length, first + n)
                if lo < hi:
                    out.append((lo - first, features[:, row + lo - start : row + hi - start]))
                row += length
        return out

    def embed(self, ids: torch.Tensor, index: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """The step's input embeddings [1, N, hidden]: `ids` [1, N] looked up (the pictures'
        positions hold a placeholder id), then `features[0]` [M, hidden] written at `index` [M]."""
        embeds = self._embed(ids)
        embeds[0, index] = features[0].to(embeds.dtype)
        return embeds

    def deepstack(self, n: int, index: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """The step's deepstack inputs (`StepContext.deepstack`) for `n` tokens, `features`
        [1 + layers, M, hidden] at `index` [M]; None for a family without deepstack layers."""
        if features.shape[0] == 1:
            return None
        order = torch.argsort(index)  # transformers takes them in position order
        mask = torch.zeros(1, n, dtype=torch.bool, device=index.device)
        mask[0, index] = True
        return mask, list(features[1:, order])


def _rows(features) -> torch.Tensor:
    """An encoder output's feature rows [L, hidden] (a tuple per picture, or one tensor)."""
    if isinstance(features, (list, tuple)):
        return torch.cat(list(features), dim=0)
    return features.reshape(-1, features.shape[-1])


def install_deepstack(model) -> bool:
    """Hand each step's deepstack rows (`StepContext.deepstack`) to `model`'s language model,
    whose own forward adds them after its first layers; False (nothing installed) for a model
    without deepstack. Calls outside a step (transformers' own `generate`) run as they were."""
    language_model = getattr(model.base_model, "language_model", None)
    if language_model is None or "deepstack_visual_embeds" not in inspect.signature(language_model.forward).parameters:
        return False
    if getattr(language_model, "_kvserve_deepstack", False):
        return True
    original = language_model.forward  # bound: transformers' decorated forward

    def forward(*args, **kwargs):
        step = context.current()
        if step is not None and step.deepstack is not None and kwargs.get("deepstack_visual_embeds") is None:
            kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = step.deepstack
        return original(*args, **kwargs)

    language_model.forward = forward
    language_model._kvserve_deepstack = True
    return True


def shift(spans: Sequence[ImageSpan], length: int) -> int:
    """How far the rope position of the token at index `length` runs from it: the shifts of the
    pictures that end at or before it (0 where positions are 1-D)."""
    return sum(span.shift for span in spans if span.end <= length)


def rope_positions(spans: Sequence[ImageSpan], first: int, n: int) -> list[list[int]] | None:
    """The 3-D rope positions [3][n] of the tokens at indexes [first, first + n) where some are a
    picture's with a grid (M-RoPE); None where the row's positions are 1-D (its index plus
    `shift`)."""
    if not any(s.grid is not None and s.start < first + n and s.end > first for s in spans):
        return None
    text = [i + shift(spans, i) for i in range(first, first + n)]
    out = [list(text), list(text), list(text)]
    for span in spans:
        if span.grid is None or span.end <= first or span.start >= first + n:
            continue
        base = span.start + shift(spans, span.start)
        grid, k = span.grid.tolist(), 0  # k: the placeholder's index in the picture
        for start, length in span.runs:
            for i in range(max(start, first), min(start + length, first + n)):
                for axis, offsets in zip(out, grid):
                    axis[i - first] = base + offsets[k + i - start]
            k += length
    return out


def reach(spans: Sequence[ImageSpan], first: int, n: int) -> list[int] | None:
    """The last position each token at [first, first + n) sees: a `whole` picture's token the
    end of its run, any other its own; None where no such picture is among them."""
    runs = [(start, length) for s in spans if s.whole for start, length in s.runs if start < first + n and start + length > first]
    if not runs:
        return None
    out = list(range(first, first + n))
    for start, length in runs:
        for i in range(max(start, first), min(start + length, first + n)):
            out[i - first] = start + length - 1
    return out


def fit(spans: Sequence[ImageSpan], first: int, n: int) -> int:
    """`n` tokens from `first`, or as many as end outside a `whole` picture's run: cut back to
    its start, or grown to its end where the chunk starts at it (a picture is computed in one
    pass, even past the step's token budget)."""
    for span in spans:
        if not span.whole:
            continue
        for start, length in span.runs:
            if start < first + n < start + length:
                n = start - first if start > first else start + length - first
    return n


def serves(config) -> bool:
    """Whether the images of `config`'s family are fed here (`FAMILIES`)."""
    return getattr(config, "model_type", None) in FAMILIES


def sees_images(model, exact: bool = False) -> bool:
    """Whether `model` is a vision-language model of `FAMILIES`, whose pictures this module feeds
    (in `exact` mode, not a `WHOLE` family's: exact mode's attention spans do not reach across
    a picture, so such a model serves text there, its images a 400)."""
    return serves(model.config) and callable(getattr(model.base_model, "get_image_features", None)) \
        and image_token_id(model.config) is not None and not (exact and model.config.model_type in WHOLE)


def image_token_id(config) -> int | None:
    """The placeholder token a picture's run is written with (`image_token_id`; older
    configs: `image_token_index`)."""
    found = getattr(config, "image_token_id", None)
    return getattr(config, "image_token_index", None) if found is None else found


def placeholder_ids(ids: list[int], placeholder: int) -> list[int]:
    """`ids` with each picture's key id (`key_ids`) back to the model's placeholder token."""
    return [placeholder if i < 0 else i for i in ids]
