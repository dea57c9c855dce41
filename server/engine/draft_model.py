"""A small draft model (same tokenizer) as the speculative-decoding proposer.

Each sequence gets the draft model's own KV (a `kv.SequenceKV` of the draft model, as large as
the sequence's cache), kept in step with the sequence's tokens by the same rules as the
target's cache:

* before drafting it catches up on the tokens it has not seen (the prompt the first time, then
  the last step's accepted tokens and the new one): one batched forward pass of the draft model
  over all drafting rows, then one batched pass per further drafted token;
* after verification it is cropped back to the accepted prefix (`kv.crop`);
* when a session's request commits, its draft cache stays with the session in a small LRU,
  and the session's next request reuses it up to the longest common token prefix
  (`cache_manager.prefix.decide_reuse`), so a later turn does not run the draft model over the
  whole conversation again.

Memory: the draft caches of running sequences and those kept for idle sessions share
`budget_bytes`, the draft's part of the KV budget (`draft_budget_for`), in a pool of their own:
kept ones are evicted (least recently kept first) whenever running ones need the room. A
running sequence's draft cache is as large as its cache, so running ones alone fit as long as
the model's caches fit the rest of the budget; a sequence whose draft cache does not fit does
not draft.

Shapes: draft logits [rows, vocab] float32; a sampled row's proposal distributions [k, vocab].
"""

from __future__ import annotations

import math
import time

import torch

from cache_manager import kv
from cache_manager.prefix import decide_reuse
from cache_manager.sessions import Entry, SessionStore
from server.engine.attention import Row
from server.engine.model_runner import ModelRunner
from server.engine.sampling import draw_rows, filtered_probs
from server.engine.speculative import Draft


class DraftModelProposer:
    """Drafts with `model`; `budget_bytes` bounds its caches, running and kept together."""

    EMA = 0.2

    def __init__(self, model, max_context: int, budget_bytes: int, packed: bool = True, exact: bool = False) -> None:
        self.model = model
        self.packed = packed  # cpu_linear.pack_model's `packed`
        # exact mode (server/engine/exact.py): the draft's own forward passes batch-invariant too, and
        # every draft is its argmax (`_draw`)
        self.exact = exact
        self.max_context = max_context
        self.budget_bytes = budget_bytes
        # the draft model's own pool and runner (no CUDA graphs: a draft step is small and
        # its rows catch up by several tokens)
        self.pool = kv.Pool(model.config, budget_bytes, model.device, model.dtype)
        self.runner = ModelRunner(model, self.pool, max_context=max_context, packed=packed, cuda_graphs=False, exact=exact, merge=True,
                                  overlap=False)  # the engine's steps overlap, not the draft's
        # idle sessions' draft caches, least recently committed first out (no TTL: the
        # sessions' own expiry is the model's cache manager's business)
        self._kept = SessionStore(budget_bytes, math.inf, remember_dropped=0, on_drop=self._dropped)
        # bytes of the draft cache of each running sequence (by id: a failed draft drops the
        # sequence's cache without telling; its release still comes)
        self._running: dict[int, int] = {}
        self._token_s = 0.0  # measured seconds per drafted token (0 until the first draft)
        self._taking: kv.SequenceKV | None = None  # the kept cache `_take` is handing on

    # -- Proposer ------------------------------------------------------------------------------

    def prepare(self) -> None:
        self.runner.prepare()

    def limit(self, seq, k: int) -> int:
        try:
            cache = self._cache(seq)
        except kv.NoBlocks:  # the draft pool is full of running sequences' caches
            return 0
        catch_up = len(seq.all_ids) - kv.length(cache)
        while k > 0 and not kv.can_crop_after(cache, catch_up + k - 1):
            k -= 1
        return k

    def propose(self, seqs: list, ks: list[int]) -> list[Draft]:
        """k forward passes of the draft model at most (all rows batched in each): the first
        catches each row up and drafts its first token, each further one drafts one more."""
        t0 = time.perf_counter()
        caches = [seq.spec.proposer for seq in seqs]
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        feed = [seq.all_ids[kv.length(cache) :] for seq, cache in zip(seqs, caches)]
        # NOTE: only drafts without a long catch-up (a new prompt) say what a drafted token costs
        steady = max(len(f) for f in feed) <= 2
        active = list(range(len(seqs)))
        while active:
            rows = [Row(caches[i], len(feed[i])) for i in active]
            logits = self.runner.forward(rows, [t for i in active for t in feed[i]], list(range(len(rows))))
            for j, i in enumerate(active):
                token, q = self._draw(seqs[i], logits[j])
                tokens[i].append(token)
                if q is not None:
                    probs[i].append(q)
                feed[i] = [token]
            active = [i for i in active if len(tokens[i]) < ks[i]]
        if steady:
            drafted = sum(len(t) for t in tokens)
            self._token_s += self.EMA * ((time.perf_counter() - t0) / drafted - self._token_s)
        return [Draft(t, torch.stack(p) if p else None) for t, p in zip(tokens, probs)]

    def peek(self, seq) -> None:
        return None  # knowing its first token takes a forward pass of the draft model

    def token_seconds(self) -> float:
        return self._token_s

    def rewind(self, seq, n_valid: int) -> None:
        cache = seq.spec.proposer
        if kv.length(cache) > n_valid:
            kv.crop(cache, n_valid)

    def used_bytes(self) -> int:
        """Bytes of the draft caches of running sequences and idle sessions."""
        return self._running_bytes() + self._kept.used_bytes

    def _running_bytes(self) -> int:
        return sum(self._running.values())

    def release(self, seq, committed: bool) -> None:
        self._running.pop(id(seq), None)
        cache, seq.spec.proposer = seq.spec.proposer, None
        key = seq.lease.key if seq.lease is not None else None
        if cache is None:
            return
        if not committed or key is None:
            kv.free(cache)
            return
        n = min(kv.length(cache), len(seq.all_ids))
        if n < kv.length(cache):
            kv.crop(cache, n)
        self._keep(key, seq.all_ids[:n], cache)

    # -- internals -----------------------------------------------------------------------------

    def _draw(self, seq, logits: torch.Tensor) -> tuple[int, torch.Tensor | None]:
        """The next drafted token: the draft's argmax for greedy rows, else a draw from its
        distribution under the request's temperature / top-k / top-p (returned as q).

        NOTE: in exact mode every row drafts its argmax (q a point mass): a draw would take
        from the request's generator, and the standard rule for a drawn draft draws
        differently from decoding without one, so a seeded request's tokens would change with
        speculation. A point mass is verified with one draw per emitted token
        (`accept_point_mass`), the draws decoding makes without a draft."""
        if seq.params.greedy or self.exact:
            return int(torch.argmax(logits)), None
        q = filtered_probs(logits[None], [seq.params])[0]
        return draw_rows(q[None], [seq.generator])[0], q

    def _cache(self, seq) -> kv.SequenceKV:
        """The sequence's draft cache: its own, a session's kept one reused up to the common
        prefix, or a new one as large as the sequence's cache."""
        cache = seq.spec.proposer
        if cache is not None:
            return cache
        capacity = kv.capacity(seq.cache)
        key = seq.lease.key if seq.lease is not None and seq.request.use_session else None
        kept = self._take(key) if key is not None else None
        if kept is not None:
            tokens, cache = kept
            decision = decide_reuse(tokens, seq.all_ids)
            if decision.n_reused > 0:
                kv.crop(cache, decision.n_reused)
                try:
                    kv.grow(cache, capacity)
                except kv.NoBlocks:
                    kv.free(cache)
                    raise
                return self._run_with(seq, cache)
            kv.free(cache)
        self._kept.make_room(self._running_bytes() + kv.bytes_for(self.model.config, capacity, self.model.dtype))
        return self._run_with(seq, self.pool.allocate(capacity))

    def _run_with(self, seq, cache: kv.SequenceKV) -> kv.SequenceKV:
        """`cache` is the running sequence's draft cache: kept ones make room for it."""
        seq.spec.proposer = cache
        self._running[id(seq)] = kv.nbytes(cache)
        self._kept.make_room(self._running_bytes())
        return cache

    def _take(self, key) -> tuple[list[int], kv.SequenceKV] | None:
        """The session's kept cache, out of the kept ones (the caller owns its blocks now)."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        self._taking = kept.kv
        try:
            self._kept.delete(key)
        finally:
            self._taking = None
        return kept.tokens, kept.kv

    def _keep(self, key, tokens: list[int], cache: kv.SequenceKV) -> None:
        """Keep the session's draft cache, evicting the least recently kept ones until it fits
        beside the running ones (not kept when it does not fit at all)."""
        self._kept.delete(key)
        kv.trim(cache)
        size = kv.nbytes(cache)
        if tokens and self._kept.make_room(self._running_bytes() + size):
            self._kept.put(Entry(key, tokens, cache, size))
        else:
            kv.free(cache)

    def _dropped(self, entry: Entry, reason: str) -> None:
        """A kept cache leaves the store: its blocks go back, unless `_take` hands it on."""
        if entry.kv is not self._taking:
            kv.free(entry.kv)


def check_compatible(model, tokenizer, draft_model, draft_tokenizer) -> None:
    """ValueError unless the draft model can propose tokens for `model`: the same vocabulary
    (token ids mean the same text) and the same logits width."""
    width = model.config.get_text_config(decoder=True).vocab_size
    draft_width = draft_model.config.get_text_config(decoder=True).vocab_size
    if width != draft_width:
        raise ValueError(f"the draft model's vocabulary has {draft_width} entries, the model's {width}")
    if tokenizer.get_vocab() != draft_tokenizer.get_vocab():
        raise ValueError("the draft model's tokenizer differs from the model's")
    if draft_model.device != model.device or draft_model.dtype != model.dtype:
        raise ValueError("the draft model must be on the model's device, in its dtype")


def draft_budget_for(model, draft_model, budget_bytes: int, max_context: int, kv_dtype: str = "auto") -> int:
    """The draft caches' part of a KV budget: r / (1 + r) of it, r the draft's KV bytes per
    token over the model's (stored as `kv_dtype`; the draft's own caches keep its dtype), so
    every token the model's caches hold (in the rest) has room for its draft KV too."""
    ratio = kv.bytes_for(draft_model.config, max_context, draft_model.dtype) / kv.bytes_for(model.config, max_context, model.dtype, kv_dtype)
    return int(budget_bytes * ratio / (1 + ratio))
