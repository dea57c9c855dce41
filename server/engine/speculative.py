"""Speculative decoding: draft tokens cheaply, verify them in the step's one forward pass, keep
the accepted prefix, crop the rest from the KV cache.

One engine step with speculation (still schedule -> run -> postprocess):

1. after `Scheduler.schedule`, `Speculator.draft(plan)` gives some decode rows a `Draft`: tokens
   proposed by a `Proposer` (prompt lookup, server/engine/prompt_lookup.py, or a small draft model,
   server/engine/draft_model.py), as many per row as `allocate` finds worth their cost, within what
   the step's token budget leaves; a grammar row's draft is cut to what its grammar accepts;
2. `model_runner.run` computes each such row's pending token and its draft in the same forward
   pass (KV written for all of them) and returns logits at every one of those positions;
3. the engine's postprocess calls `Speculator.verify`, which has the sampler pick the tokens
   exactly as decoding without a draft would, position by position (`sampler.verify`), and
   stops at the first rejected draft token;
   the engine crops the rejected ones from the cache (`kv.crop`) and emits the accepted ones
   and the token chosen after them as one output, as decoding would have in as many steps.

Exactness. Greedy: a drafted token is accepted iff it is the argmax of its position's logits
(after grammar mask, bias and penalties), so the output is the one without speculation (up to
the near-ties of docs/architecture.md: the logits of a multi-token forward pass round
differently from a one-token pass). Sampling: the standard rule (Leviathan et al. 2023, Chen
et al. 2023), `sampler.accept_or_resample`: accept x ~ q with probability min(1, p(x) / q(x)), else
draw from norm(max(0, p - q)); every emitted token is distributed as p. A prompt-lookup draft
is deterministic (q is a point mass on x): the rule then accepts with probability p(x), which
`sampler.accept_point_mass` implements as one draw y ~ p, accepted iff y == x (else y is the residual
draw): one draw per emitted token from the request's generator, as without speculation, so a
seeded request draws the same tokens with or without prompt lookup.

Draft lengths (`allocate`): row r's j-th drafted token is accepted with probability a_r ** j
(a_r: the row's recent acceptance rate of drafts from the source its draft comes from this
step, `SpecState.alpha`) and the step's forward pass costs
`StepCost.seconds(tokens)`, learned from the steps the engine runs. Drafting maximises the
step's expected tokens per second, so a row drafts less as its acceptance falls, and rows
draft less as the batch (and with it the price of each extra token) grows; with nothing worth
its cost nobody drafts and the step is exactly the one without speculation.

Shapes: a draft of k tokens is verified with logits [k + 1, vocab] (float32, the rows of the
step's logits for that sequence); a draft model's proposal distributions are [k, vocab].
"""

from __future__ import annotations

import bisect
import logging
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from cache_manager import kv
from grammars.matcher import start_draft_masks
from server.engine import sampler
from server.engine.sequence import Status, TokenInfo

log = logging.getLogger(__name__)


# -- draft lengths ---------------------------------------------------------------------------


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens one verification yields on average with k drafted tokens (a geometric model:
    each accepted with probability alpha once the ones before it were): 1 + a + ... + a**k."""
    return sum(alpha**j for j in range(k + 1))


def allocate(alphas: list[float], limits: list[int], base_yield: float, cost, budget: int) -> list[int]:
    """Draft lengths per row that maximise the step's expected tokens per second.

    Row r's j-th drafted token adds alphas[r] ** j expected tokens; `cost(n)` is the step's
    cost with n drafted tokens in it (n = 0: the step as scheduled, yielding `base_yield`).
    Each row's gains fall with j, so taking the largest gains first gives the best draft for
    every total n <= `budget`; the total with the best expected rate wins (0: nobody drafts).
    """
    gains = sorted(
        ((a**j, r) for r, (a, limit) in enumerate(zip(alphas, limits)) for j in range(1, limit + 1)),
        key=lambda g: -g[0],
    )[: max(budget, 0)]
    best_rate, best_n, total = base_yield / cost(0), 0, base_yield
    for n, (gain, _) in enumerate(gains, 1):
        total += gain
        rate = total / cost(n)
        if rate > best_rate:
            best_rate, best_n = rate, n
    ks = [0] * len(alphas)
    for _, r in gains[:best_n]:
        ks[r] += 1
    return ks


class StepCost:
    """Seconds of one forward pass by the number of tokens it computes, learned from the steps
    the engine runs: per size bucket the median of the last observations (robust to a noisy
    neighbour), made non-decreasing in size (`_monotone`), linear between measured buckets;
    past the largest measured size it grows by that size's cost per token (a deliberately
    pessimistic prior for an unseen size, which the next step then measures).

    NOTE: the raw medians are not monotone: on a 2-core CPU one extraction run at 4 streams
    measured 4, 6, 7, 8, 9 tokens at 46, 56, 52, 58, 53 ms, so drafting 3 or 5 more tokens
    looked cheaper than 2 or 4, and rows whose drafts were worth one token drafted 5-7."""

    WINDOW = 9

    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}
        self._sizes: list[int] = []
        self._fitted: list[float] | None = None  # `_monotone`'s medians, by `_sizes`

    @staticmethod
    def bucket(n_tokens: int) -> int:
        """Exact up to 16 tokens, then steps of about 12%."""
        if n_tokens <= 16:
            return max(n_tokens, 1)
        return round(16 * 1.125 ** round(math.log(n_tokens / 16, 1.125)))

    def observe(self, n_tokens: int, seconds: float) -> None:
        b = self.bucket(n_tokens)
        if b not in self._samples:
            self._samples[b] = deque(maxlen=self.WINDOW)
            bisect.insort(self._sizes, b)
        self._samples[b].append(seconds)
        self._fitted = None

    def seconds(self, n_tokens: int) -> float:
        sizes = self._sizes
        if not sizes:
            return 1.0 + n_tokens / 64  # nothing measured yet: only ratios matter
        if self._fitted is None:
            self._fitted = self._monotone()
        fitted = self._fitted
        i = bisect.bisect_left(sizes, n_tokens)
        if i < len(sizes) and sizes[i] == n_tokens:
            return fitted[i]
        if i == 0:
            return fitted[0]
        lo, t_lo = sizes[i - 1], fitted[i - 1]
        if i == len(sizes):
            return t_lo * (1 + (n_tokens - lo) / max(lo, 16))
        return t_lo + (fitted[i] - t_lo) * (n_tokens - lo) / (sizes[i] - lo)

    def _monotone(self) -> list[float]:
        """The buckets' medians, non-decreasing in size: where a bigger bucket measured
        cheaper than a smaller one, both get their mean, weighted by their samples (the
        pool-adjacent-violators fit, least squares under the order)."""
        blocks: list[list[float]] = []  # [mean, weight, buckets pooled]
        for b in self._sizes:
            blocks.append([statistics.median(self._samples[b]), len(self._samples[b]), 1])
            while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                mean, weight, count = blocks.pop()
                last = blocks[-1]
                last[0] = (last[0] * last[1] + mean * weight) / (last[1] + weight)
                last[1] += weight
                last[2] += count
        return [mean for mean, _, count in blocks for _ in range(count)]


# -- per-sequence state and proposers ------------------------------------------------------------


@dataclass(slots=True)
class Draft:
    """What one row verifies this step: `tokens` (never end-of-turn), the draft model's
    distributions they were drawn from (`probs` [k, vocab]; None: deterministic, e.g. greedy
    or prompt lookup), and whether decoding without a draft would not sample after the last
    token (`ends_forced`: the grammar completes there or forces the next tokens)."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    ends_forced: bool = False


class DecayedCounts:
    """Decayed [hits, misses] of drafts per source: each observation weighs `decay` times the
    one after it, and `relax` scales a source's counts toward its prior (pseudo-counts)."""

    __slots__ = ("counts", "decay", "relaxation")

    def __init__(self, decay: float, relaxation: float) -> None:
        self.counts: dict[str, list[float]] = {}  # source -> [hits, misses]
        self.decay, self.relaxation = decay, relaxation

    def rate(self, source: str, prior: tuple[float, float]) -> float:
        """The acceptance rate of `source`, with pseudo-counts `prior` (hits, misses)."""
        hits, misses = self.counts.get(source, (0.0, 0.0))
        a, b = prior
        return (hits + a) / (hits + misses + a + b)

    def observe(self, source: str, hits: float, missed: bool) -> None:
        count = self.counts.setdefault(source, [0.0, 0.0])
        count[0] = count[0] * self.decay + hits
        count[1] = count[1] * self.decay + missed

    def relax(self, sources: Iterable[str]) -> None:
        for source in sources:
            count = self.counts.get(source)
            if count is not None:
                count[0] *= self.relaxation
                count[1] *= self.relaxation


class SharedAcceptance:
    """The acceptance of drafts from each source across all of an engine's sequences (slowly
    decayed counts): where a new sequence's own rate starts, instead of an even guess, so its
    first drafts are as long as the server's recent experience with that source warrants.

    Greedy and sampled requests share apart: sampling accepts a drafted token with the
    model's probability. What it gained: docs/benchmarks.md, "The drafting rules".
    """

    WEIGHT = 2.0  # pseudo-counts (hits + misses) a sequence's own rate starts with
    DECAY = 0.97  # per observation, over all sequences: roughly the last 30 weigh in
    RELAX = 0.95  # per step a sequence can neither draft nor observe: back toward an even guess

    def __init__(self) -> None:
        self._rates = DecayedCounts(self.DECAY, self.RELAX)

    def pseudo_counts(self, source: str) -> tuple[float, float]:
        rate = self._rates.rate(source, SpecState.PRIOR)
        return self.WEIGHT * rate, self.WEIGHT * (1 - rate)

    def observe(self, source: str, hits: float, missed: bool) -> None:
        self._rates.observe(source, hits, missed)

    def relax(self, source: str) -> None:
        """A step taught nothing about `source` (no draft, no free observation: a draft
        model's rows): its rate drifts back to an even guess, so a rate that fell low enough
        to stop all drafting cannot stay there for good."""
        self._rates.relax([source])


@dataclass(slots=True)
class SpecState:
    """One sequence's speculation: its recent acceptance (decayed counts, kept apart for each
    source the proposer copies from, starting from the engine's `shared` experience) and
    totals, and the proposer's own state (an n-gram index, a draft model's cache)."""

    drafted: int = 0
    accepted: int = 0
    proposer: object | None = None
    source: str = ""  # where the proposer's draft comes from this step (set by `Proposer.limit`)
    shadow: tuple[int, int, str] | None = None  # (position, token, source) of a skipped draft's start
    rates: DecayedCounts = field(default_factory=lambda: DecayedCounts(SpecState.DECAY, SpecState.RELAX))
    shared: SharedAcceptance | None = None

    PRIOR = (1.0, 1.0)  # pseudo-counts (hits, misses) without `shared`: alpha starts at 0.5
    DECAY = 0.85  # per observation: roughly the last seven weigh in
    RELAX = 0.95  # per step without a draft nor a shadow: alpha drifts back to the prior
    # (with `shared`: the shared rate, which itself drifts back to 0.5)

    @property
    def alpha(self) -> float:
        """The recent acceptance rate of drafts from the current `source`."""
        prior = self.PRIOR if self.shared is None else self.shared.pseudo_counts(self.source)
        return self.rates.rate(self.source, prior)

    def record(self, drafted: int, accepted: int) -> None:
        self._observe(self.source, accepted, accepted < drafted)
        self.drafted += drafted
        self.accepted += accepted

    def _observe(self, source: str, hits: float, missed: bool) -> None:
        self.rates.observe(source, hits, missed)
        if self.shared is not None:
            self.shared.observe(source, hits, missed)

    def relax(self) -> None:
        self.rates.relax(self.rates.counts)
        if self.shared is not None:
            self.shared.relax(self.source)

    def skip(self, position: int, token: int | None) -> None:
        """This step drafts nothing where the draft would have begun with `token` at
        `position` (None: not known without work): kept as a shadow to settle for free, or
        else a step that taught nothing."""
        if token is None:
            self.relax()
        else:
            self.shadow = (position, token, self.source)

    def settle_shadow(self, ids: list[int]) -> None:
        """A step that did not draft still tells whether its draft would have begun right (a
        free observation, when the proposer knew its first token without work)."""
        if self.shadow is not None and len(ids) > self.shadow[0]:
            position, token, source = self.shadow
            self.shadow = None
            hit = ids[position] == token
            self._observe(source, hit, not hit)


class Proposer(Protocol):
    """Where drafts come from. Engine thread only."""

    def prepare(self) -> None:
        """Before the engine's first step (a draft model: its runner's `prepare`, on the engine
        thread)."""

    def limit(self, seq, k: int) -> int:
        """How many tokens (<= k) it could draft for `seq` now (prompt lookup: the match).
        A proposer with several sources sets `seq.spec.source` to the one it would draft from
        (prompt lookup: "prompt" or "output"); a single-source one leaves it "" ."""

    def propose(self, seqs: list, ks: list[int]) -> list[Draft]:
        """Drafts of ks[i] tokens (or fewer) for seqs[i]."""

    def peek(self, seq) -> int | None:
        """The first token it would draft, if known without work (after `limit`), else None."""

    def token_seconds(self) -> float:
        """What drafting one token costs (0 for prompt lookup)."""

    def rewind(self, seq, n_valid: int) -> None:
        """After verification: only `seq`'s first `n_valid` tokens are real."""

    def release(self, seq, committed: bool) -> None:
        """The sequence ended (`committed`: its session keeps its tokens)."""


# -- the engine's view ---------------------------------------------------------------------------


@dataclass(slots=True)
class SpeculativeConfig:
    max_draft: int = 15  # tokens one row may draft per step
    adaptive: bool = True  # False: every eligible row drafts what its proposer offers (tests)

    def __post_init__(self) -> None:
        if not 1 <= self.max_draft <= 64:
            raise ValueError("max_draft must be in [1, 64]")


class NoSpeculation:
    """Speculation off: every verb does nothing."""

    timed = False  # the engine need not wait for a step to end to time it (`observe`)

    def prepare(self) -> None:
        pass

    def draft(self, plan, max_batch_tokens: int) -> None:
        pass

    def observe(self, n_tokens: int, seconds: float) -> None:
        pass

    def finish(self, seq, committed: bool) -> None:
        pass

    def discard(self, row) -> None:
        row.draft = None


class Speculator:
    """Drafting before the forward pass and verification after it, for one engine."""

    timed = True  # `observe` wants each step's time on the device (the draft-length choice)

    def __init__(self, proposer: Proposer, eos_ids: frozenset[int], config: SpeculativeConfig | None = None, metrics=None) -> None:
        self.proposer = proposer
        self.eos_ids = eos_ids
        self.config = config or SpeculativeConfig()
        self.metrics = metrics
        self.cost = StepCost()
        self.acceptance = {True: SharedAcceptance(), False: SharedAcceptance()}  # greedy or not

    def prepare(self) -> None:
        self.proposer.prepare()

    # -- before the forward pass ---------------------------------------------------------------

    def draft(self, plan, max_batch_tokens: int) -> None:
        """Give the plan's eligible decode rows their drafts (may run a draft model). A row is
        eligible when it opted in, completes its pending tokens this step (its last sampled
        token, and the run a grammar forced after it: those need no draft, the draft follows
        them), has room for another token after the draft, and its cache can take the draft and
        crop it again (a sliding window about to wrap cannot: no speculation for that
        sequence). A thinking model's row drafts no further than its thinking budget, and not
        at all while its constraint changes at the answer (a grammar, or banned call markers). Drafting never fails a request: on an
        error nobody drafts."""
        rows, limits = [], []
        for row in plan.rows:
            seq = row.seq
            if not (row.completes and seq.status is Status.DECODE and seq.request.speculative and not seq.request.images):
                continue
            k = min(self.config.max_draft, seq.params.max_tokens - len(seq.generated) - 1)
            reasoning = seq.reasoning
            if reasoning is not None and not reasoning.answering:
                if seq.matcher is not None or reasoning.spec.banned_ids:  # its constraint changes at the answer
                    continue
                if (left := reasoning.budget_left()) is not None:  # the thinking budget's end is forced
                    k = min(k, left - 1)  # the token verification samples after the draft is one more
            while k > 0 and not kv.can_crop_after(seq.cache, row.n_tokens + k):
                k -= 1
            if k <= 0:
                continue
            if seq.spec is None:
                seq.spec = SpecState(shared=self.acceptance[seq.params.greedy])
            seq.spec.settle_shadow(seq.all_ids)
            k = self.proposer.limit(seq, k)
            if k > 0:
                rows.append(row)
                limits.append(k)
        if not rows:
            return
        try:
            self._draft(plan, rows, limits, max_batch_tokens)
        except Exception:
            log.exception("drafting failed; this step runs without drafts")
            for row in rows:
                row.draft = None
                row.seq.spec.proposer = None  # whatever it held may be half-written

    def _draft(self, plan, rows, limits, max_batch_tokens: int) -> None:
        if self.config.adaptive:
            base = plan.num_tokens
            per_token = self.proposer.token_seconds()
            decoding = sum(1 for r in plan.rows if r.completes)
            ks = allocate(
                [r.seq.spec.alpha for r in rows], limits, decoding,
                lambda n: self.cost.seconds(base + n) + n * per_token, max_batch_tokens - base,
            )
        else:
            ks = limits
        chosen = [(row, k) for row, k in zip(rows, ks) if k > 0]
        for row, k in zip(rows, ks):
            if k == 0:
                row.seq.spec.skip(len(row.seq.all_ids), self.proposer.peek(row.seq))
        if not chosen:
            return
        drafts = self.proposer.propose([row.seq for row, _ in chosen], [k for _, k in chosen])
        masked = []
        for (row, _), draft in zip(chosen, drafts):
            seq = row.seq
            cut = next((i for i, t in enumerate(draft.tokens) if t in self.eos_ids), len(draft.tokens))
            if seq.matcher is not None:
                n, draft.ends_forced = seq.matcher.draft_prefix(draft.tokens[:cut], stop_at_forced=not seq.params.logprobs)
                cut = n
            if cut == 0:
                self.proposer.rewind(seq, len(seq.all_ids))
                continue
            draft.tokens = draft.tokens[:cut]
            if draft.probs is not None:
                draft.probs = draft.probs[:cut]
            row.draft = draft
            if seq.matcher is not None:
                masked.append((seq.matcher, draft.tokens))
        start_draft_masks(masked)

    def observe(self, n_tokens: int, seconds: float) -> None:
        """A forward pass of `n_tokens` took `seconds` (feeds the draft-length choice)."""
        self.cost.observe(n_tokens, seconds)

    def discard(self, row) -> None:
        """Take a row's draft back before its forward pass (the engine shrinks a step that ran
        out of memory): the proposer forgets the drafted tokens, and the grammar's draft masks
        started for them are collected unused."""
        seq = row.seq
        row.draft = None
        self.proposer.rewind(seq, len(seq.all_ids))
        if seq.matcher is not None:
            try:
                seq.matcher.draft_masks()
            except RuntimeError:  # none were started (the draft needed no mask)
                pass

    # -- after it ------------------------------------------------------------------------------

    def verify(self, seq, draft: Draft, logits: torch.Tensor) -> tuple[list[TokenInfo], int]:
        """The tokens decoding emits for a row that carried `draft`, from its raw logits
        [k + 1, vocab]: the accepted drafted tokens, then the token chosen at the first rejected
        position (or after the whole draft, unless `draft.ends_forced`). Returns them and how
        many drafted tokens were accepted.

        Side effects, as sampling those tokens one step at a time would have: grammar masks
        are added to `logits` in place, penalty counts move forward, the request's generator
        draws; plus the sequence's acceptance statistics and the proposer's rewind.
        """
        k = len(draft.tokens)
        tokens, accepted = sampler.verify(seq, draft.tokens, draft.probs, logits, draft.ends_forced)
        seq.spec.record(k, accepted)
        self.proposer.rewind(seq, len(seq.all_ids) + accepted)
        if self.metrics is not None:
            self.metrics.spec_draft_tokens.inc(k)
            self.metrics.spec_accepted_tokens.inc(accepted)
            self.metrics.spec_tokens_per_forward.observe(len(tokens))
        return tokens, accepted

    def finish(self, seq, committed: bool) -> None:
        """The sequence ended: its acceptance rate goes to the metrics; the proposer lets go
        (a draft model's cache may stay with the session)."""
        spec = seq.spec
        if spec is None:
            return
        if spec.drafted and self.metrics is not None:
            self.metrics.spec_acceptance_rate.observe(spec.accepted / spec.drafted)
        try:
            self.proposer.release(seq, committed)
        except Exception:
            log.exception("releasing the draft state of %s failed", seq.request_id)
        seq.spec = None
