"""One request's generation state inside the engine, and the outputs it streams back.

The HTTP side only ever sees `RequestOutput`s (plain data); the engine thread owns everything
else here and is the only one to mutate it, except `cancelled`, which any thread may set.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch

from cache_manager import kv
from server.engine import vision
from server.engine.detokenizer import TextStream
from server.engine.reasoning import Reasoning, ReasoningSpec
from server.engine.sampling import SamplingParams, make_generator

if TYPE_CHECKING:  # annotations only: lora imports this module's neighbours
    from grammars import CompiledGrammar
    from server.engine.lora import Adapter
    from server.engine.vision import ImageSpan


@dataclass(slots=True)
class GenerationRequest:
    """What the HTTP layer asks of the engine: token ids in, tokens out."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    timeout_s: float | None = None
    principal: str = "anonymous"
    session_id: str | None = None  # None: may reuse the principal's anonymous entries
    use_session: bool = True  # False: a private cache (the extra choices of n > 1)
    grammar: CompiledGrammar | None = None  # each sequence gets a matcher of it
    speculative: bool = True  # False: never draft for this request (when the server speculates)
    reasoning: ReasoningSpec | None = None  # a thinking model's markers and budget (server/engine/reasoning.py)
    fault: str | None = None  # a fault to inject into its rows (server/engine/faults.py; tests only)
    adapter: Adapter | None = None  # its LoRA adapter (server/engine/lora.py); None: the base model
    # its pictures (server/engine/vision.py), whose runs `prompt_ids` holds as key ids
    images: tuple[ImageSpan, ...] = ()
    # makes each sequence's watcher of its answer (server/api/assembly.py's `Assembly`): fed
    # every token's output, its `ended` stops the sequence at that token (a repeated tool call)
    watch: Callable[[], Any] | None = None

    @property
    def session_key(self) -> tuple[str, str] | None:
        """The key that must not run twice at once (anonymous requests never collide)."""
        if not self.use_session or self.session_id is None:
            return None
        return (self.principal, self.session_id)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")


@dataclass(slots=True)
class TokenInfo:
    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class Appended:
    """What appending generated tokens added to the output; `stopped`: a stop string or the
    request's watcher ended it."""

    output: "RequestOutput"
    stopped: bool = False


@dataclass(slots=True)
class RequestOutput:
    """A chunk of one request's result; the last one has `finish_reason` (or `error`) set."""

    text: str = ""  # the answer's text (a thinking model's reasoning is `reasoning`)
    tokens: list[TokenInfo] = field(default_factory=list)
    reasoning: str = ""  # reasoning text (without its markers)
    n_reasoning: int = 0  # how many of `tokens`, from the first, belong to the reasoning (markers included)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # "timeout" | "internal" | "out_of_memory" | "kv_budget" | "grammar"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # completion tokens before the answer (usage's reasoning_tokens)
    miss_reason: str | None = None  # why nothing was reused (None on a hit)
    stop: str | None = None  # the stop string that ended the answer (the final output's)
    admitted: bool = False  # the first output: the engine took the request, cache decided

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Status(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


class Sequence:
    """Prompt, generated tokens, KV cache and sampling state of one running request."""

    def __init__(self, request: GenerationRequest, tokenizer, device: torch.device | str = "cpu") -> None:
        self.request = request
        self.params = request.params
        self.prompt_ids = request.prompt_ids
        self.generated: list[int] = []
        self.all_ids = list(request.prompt_ids)  # prompt + generated, kept by append()
        self.status = Status.WAITING
        self.lease = None  # the cache manager's Lease once admitted
        self.cache = None  # lease.cache, the kv.SequenceKV this sequence writes
        self.adapter_slot = 0  # its LoRA adapter's device slot while it runs (Engine._reserve); 0: the base model
        self.rope_long = False  # LongRoPE: its keys take the long factors (Engine._cross_rope_switch)
        self.cached_tokens = 0  # tokens reused from an earlier request
        self.miss_reason: str | None = None
        self.matcher = request.grammar.new_matcher() if request.grammar is not None else None
        # NOTE: stop strings would cut a structured output short of validity: a grammar
        # request ends when its grammar is complete (or at max_tokens) instead.
        self.text = TextStream(tokenizer, () if self.matcher is not None else request.params.stop)
        # a thinking model: its reasoning phase, and the reasoning's own text (no stop strings)
        self.reasoning = Reasoning(request.reasoning, open=self.matcher is not None) if request.reasoning else None
        self.reasoning_text = TextStream(tokenizer) if request.reasoning else None
        self.banned_words: np.ndarray | None = None  # sampler.constraint's, made once
        self._held: list[TokenInfo] = []  # generated tokens whose side (reasoning or answer) is not known yet
        self.generator = make_generator(request.params.seed, device)  # where the logits are
        self.counts: torch.Tensor | None = None  # token counts, only when penalties are on
        self.spec = None  # a speculative.SpecState once the sequence drafts
        # tokens of KV computed by a step launched ahead (Engine._launch_ahead) that a step
        # waiting for the previous one's tokens would not have computed yet: cropped when the
        # sequence ends or diverges before that step lands
        self.ahead = 0
        self.cancelled = False
        self.watch = request.watch() if request.watch is not None else None  # GenerationRequest.watch
        self.submitted_at = time.monotonic()
        self.deadline = (
            self.submitted_at + request.timeout_s if request.timeout_s is not None else None
        )

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def session_key(self) -> tuple[str, str] | None:
        return self.request.session_key

    @property
    def n_computed(self) -> int:
        """Prompt and generated tokens whose KV is in the cache: the cache's own length (the
        one counter: the model runner moves it forward, crops set it)."""
        return 0 if self.cache is None else self.cache.length

    @property
    def grammar(self):
        """The matcher that constrains the next token: None without one, and while a thinking
        model has not reached its answer (the grammar starts after the reasoning)."""
        if self.reasoning is not None and not self.reasoning.answering:
            return None
        return self.matcher

    def append(self, token: TokenInfo) -> Appended:
        """A generated (sampled or forced) token: part of the output, pending until computed.
        Returns what it adds to the output, and whether it ended the output (a stop string, or
        the request's watcher: `GenerationRequest.watch`); a thinking model's tokens whose side
        is not known yet (a marker's first tokens) come with a later one."""
        self.generated.append(token.token_id)
        self.all_ids.append(token.token_id)
        if self.reasoning is None:
            delta = self.text.push(token.token_id)
            added = Appended(RequestOutput(text=delta.text, tokens=[token]), delta.stopped)
        else:
            self._held.append(token)
            added = self._route(self.reasoning.push(token.token_id))
        if self.watch is not None and not added.stopped:
            self.watch.feed(added.output)
            added.stopped = self.watch.ended
        return added

    def flush(self) -> RequestOutput:
        """At the end of generation: held-back text and tokens."""
        if self.reasoning is None:
            return RequestOutput(text=self.text.flush())
        out = self._route(self.reasoning.flush()).output
        out.text += self.text.flush()
        out.reasoning += self.reasoning_text.flush()
        return out

    def _route(self, routed: list[tuple[int, str]]) -> Appended:
        out = RequestOutput()
        stopped = False
        for (token_id, kind), info in zip(routed, self._held):
            if stopped:
                break
            out.tokens.append(info)
            if kind == "content":
                delta = self.text.push(token_id)
                out.text += delta.text
                stopped = delta.stopped
            else:
                out.n_reasoning += 1
                if kind == "reasoning":
                    out.reasoning += self.reasoning_text.push(token_id).text
        del self._held[: len(routed)]
        return Appended(out, stopped)

    def at_length(self, more: int = 0) -> bool:
        """Whether the sequence ends for length once `more` further tokens are appended: it
        generated max_tokens, or its cache is full (the KV a step launched ahead computed is
        not counted: without that step the row would go on). The one end-of-length rule, for
        the engine's finish and for the overlap's choice of rows."""
        if len(self.generated) + more >= self.params.max_tokens:
            return True
        return self.cache is not None and self.n_computed - self.ahead >= kv.capacity(self.cache)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache (the prompt suffix, or the last sampled or forced ones)."""
        return len(self.all_ids) - self.n_computed

    @property
    def chunk_limit(self) -> int:
        """The most tokens its next forward pass may compute: every pending one, except that a
        hybrid model's prompt stops one token short of its end first, where its recurrent
        state is kept (`kv.checkpoint`: a regenerated reply resumes there)."""
        stop = len(self.prompt_ids) - 1
        if self.cache is not None and self.cache.state is not None and self.n_computed < stop:
            return min(self.num_pending, stop - self.n_computed)
        return self.num_pending

    def fit(self, n: int) -> int:
        """A chunk of `n` tokens from here, or as many as end outside a picture that is
        computed in one pass (`vision.fit`: Gemma 3's)."""
        return vision.fit(self.request.images, self.n_computed, n) if self.request.images else n

    def pending_ids(self, n: int) -> list[int]:
        """The next `n` tokens to compute."""
        return self.all_ids[self.n_computed : self.n_computed + n]

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline

    def final_output(self, finish_reason: str, error: str | None = None, rest: RequestOutput | None = None) -> RequestOutput:
        rest = rest or RequestOutput()
        return RequestOutput(
            text=rest.text,
            tokens=rest.tokens,
            reasoning=rest.reasoning,
            n_reasoning=rest.n_reasoning,
            reasoning_tokens=self.reasoning.tokens if self.reasoning is not None else 0,
            finish_reason=finish_reason,
            error=error,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.generated),
            cached_tokens=self.cached_tokens,
            miss_reason=self.miss_reason,
            stop=self.text.matched,
        )

    def admitted_output(self) -> RequestOutput:
        return RequestOutput(admitted=True, cached_tokens=self.cached_tokens, miss_reason=self.miss_reason)
