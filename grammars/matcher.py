"""Per-request grammar state: token mask, accept, rollback, fast-forward, termination.

One `Matcher` per sequence (n > 1 gives each choice its own), made by
`CompiledGrammar.new_matcher()`. It is driven by one thread, the engine's; only the mask
computation may run in the shared worker thread, and every state change waits for it first.

Shapes: logits [vocab_size] float (a row of the engine's [batch, vocab_size] logits is fine);
the mask is kept as llguidance's bitmask, int32 words [n_words] (bit i allows token i), and
becomes an additive bias [vocab_size] float32 of 0 (allowed) / -inf (disallowed) only on the
logits' device (`additive_masks`): a step's masks cross to a GPU as 1/32 of the floats' bytes
(Qwen's 152k vocabulary: 19 KB a row, not 608 KB), and the worker thread that fills them does
no per-token work. Applying a mask is one add (masked_fill with a random mask is ~20x slower
on CPU). No torch.compile kernel, so the first request does not stall.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher

_executor: ThreadPoolExecutor | None = None
_ll_executor: LLExecutor | None = None
_executor_lock = threading.Lock()
_BYTE_MASKS: dict[torch.device, torch.Tensor] = {}  # [256, 8] float32: a byte's 8 tokens' additive values, per device


def additive_masks(words: np.ndarray, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """llguidance's mask words [R, n_words] (int32, bit i of a row = token i allowed) as
    additive masks [R, vocab_size] float32 on `device`: 0 where a token is allowed, -inf
    elsewhere. The words cross in one copy that does not wait (pinned, on CUDA); there each
    byte picks its 8 tokens' values from a table of the 256 bytes' (one gather; on CPU 2-5x
    faster than numpy's unpacking and a lookup: bench/masks.py)."""
    device = torch.device(device)
    host = torch.from_numpy(np.ascontiguousarray(words, dtype=np.int32))
    packed = (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)
    table = _BYTE_MASKS.get(device)
    if table is None:
        bits = (torch.arange(256, device=device)[:, None] >> torch.arange(8, device=device)) & 1
        table = _BYTE_MASKS[device] = torch.full((256, 8), -math.inf, dtype=torch.float32, device=device).masked_fill_(bits == 1, 0.0)
    # NOTE: little-endian words: byte k of a row holds tokens 8k..8k+7, bit j token 8k + j
    masks = table.index_select(0, packed.view(torch.uint8).reshape(-1).int())
    return masks.view(packed.shape[0], -1)[:, :vocab_size]


def _mask_executor() -> ThreadPoolExecutor:
    """One worker for all matchers: masks are tens of µs, the forward pass they hide behind ms."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, "kvserve-grammar-mask")
        return _executor


def _batch_executor() -> LLExecutor:
    """llguidance's own thread pool, which fills a batch of masks in parallel."""
    global _ll_executor
    with _executor_lock:
        if _ll_executor is None:
            _ll_executor = LLExecutor()
        return _ll_executor


def start_masks(matchers: Sequence["Matcher"]) -> None:
    """Compute the next masks of a step's constrained rows, in parallel (llguidance's pool),
    in the worker thread: returns at once, so the masks are filled during the forward pass."""
    todo = [m for m in matchers if not m._mask_ready and m._pending is None]
    if len(todo) == 1:
        todo[0].start_mask()
    elif todo:
        pending = _mask_executor().submit(_compute_masks, todo)
        for m in todo:
            m._pending = pending


def start_draft_masks(items: Sequence[tuple["Matcher", Sequence[int]]]) -> None:
    """Speculative decoding: for each (matcher, drafted tokens d1..dk) the k + 1 masks of its
    current state and of the states after d1, d1 d2, ..., d1..dk, filled by llguidance's pool
    in the worker thread during the forward pass (llguidance advances through the draft and
    rolls back itself: the state is unchanged). Read them with `Matcher.draft_masks()`. The
    drafts must be ones `draft_prefix` let through."""
    if not items:
        return
    for m, _ in items:
        m._settle()
    items = [(m, [int(t) for t in d]) for m, d in items]
    pending = _mask_executor().submit(_compute_draft_masks, items)
    for m, _ in items:
        m._pending = pending


def _compute_draft_masks(items: list[tuple["Matcher", list[int]]]) -> None:
    t0 = time.perf_counter()
    n_words = items[0][0]._words.size
    words = np.zeros((sum(len(d) + 1 for _, d in items), n_words), dtype=np.int32)
    targets, row = [], 0
    for m, d in items:
        targets.append((m._ll, row, d))
        row += len(d) + 1
    # NOTE: row K + i + 1 holds the mask after the draft's first i + 1 tokens.
    _batch_executor().unsafe_compute_mask_ptr_with_draft_token(targets, words.ctypes.data, n_words * 4, len(words))
    row = 0
    for m, d in items:
        m._draft_words = words[row : row + len(d) + 1]
        m._words[:] = m._draft_words[0]
        m._mask_ready = True
        m.last_mask_s = (time.perf_counter() - t0) / len(words)
        row += len(d) + 1


def _compute_masks(matchers: list["Matcher"]) -> None:
    t0 = time.perf_counter()
    words = np.zeros((len(matchers), matchers[0]._words.size), dtype=np.int32)
    # NOTE: llguidance writes row K of the batch at pointer + K * row bytes, GIL released.
    _batch_executor().unsafe_compute_mask_ptr(
        [(m._ll, k) for k, m in enumerate(matchers)], words.ctypes.data, words.shape[1] * 4, len(matchers)
    )
    for m, row in zip(matchers, words):
        m._words[:] = row
        m._mask_ready = True
        m.last_mask_s = (time.perf_counter() - t0) / len(matchers)


class Matcher:
    """Grammar state of one sequence.

    Per decode step (see grammars/__init__.py for the loop):
    `start_mask()` before the forward pass, `apply_mask(logits)` after it, `accept(token)` for the
    sampled token, then `is_terminated` / `fast_forward_tokens()`.

    A token the grammar refuses puts the matcher in an error state for good: `accept` returns
    False and `error` says why. Its mask then allows only EOS, so the engine must fail the request
    on a False `accept` rather than let it end as a normal "stop".
    """

    def __init__(
        self,
        ll_matcher: LLMatcher,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        *,
        ll_vocab_size: int | None = None,
        fast_forward: bool = True,
    ) -> None:
        self._ll = ll_matcher
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self._fast_forward = fast_forward
        # NOTE: llguidance's vocabulary may be wider than the logits (tokens the model cannot emit).
        n_words = (max(vocab_size, ll_vocab_size or 0) + 31) // 32
        self._words = np.zeros(n_words, dtype=np.int32)
        self._pending: Future | None = None
        self._mask_ready = False
        # True per accepted token that llguidance recorded (EOS after a stop is not recorded).
        self._recorded: list[bool] = []
        self._draft_words: np.ndarray | None = None  # [k + 1, n_words]: start_draft_masks
        self.last_mask_s = 0.0  # seconds the last mask took to compute (metrics)

    # ------------------------------------------------------------------ mask

    def start_mask(self) -> None:
        """Compute the next mask in the worker thread (returns at once). Idempotent."""
        if not self._mask_ready and self._pending is None:
            self._pending = _mask_executor().submit(self._compute_mask)

    def fill_next_mask(self) -> None:
        """Make the mask for the current state ready: wait for the worker or compute it here."""
        self._wait()
        if not self._mask_ready:
            self._compute_mask()

    def next_words(self) -> np.ndarray:
        """The mask words [n_words] int32 of the current state (bit i allows token i): the
        matcher's own buffer, which its next mask overwrites. The engine applies a step's masks
        at once (server/engine/sampler.py `apply_constraints`)."""
        self.fill_next_mask()
        return self._words

    def next_mask(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The additive mask [vocab_size] float32 on `device` of the current state (0 where a
        token is allowed, -inf elsewhere)."""
        return additive_masks(self.next_words()[None], self.vocab_size, device)[0]

    def apply_mask(self, logits: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf, in place (allowed ones are untouched)."""
        if logits.shape[-1] != self.vocab_size:
            raise ValueError(f"logits width {logits.shape[-1]} != vocab_size {self.vocab_size}")
        logits.add_(self.next_mask(logits.device).to(logits.dtype))

    def draft_masks(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The additive masks [k + 1, vocab_size] float32 on `device` that `start_draft_masks`
        computed for this matcher's draft (row i: after the draft's first i tokens); waits for
        the worker."""
        self._wait()
        if self._draft_words is None:
            raise RuntimeError("no draft masks were started")
        words, self._draft_words = self._draft_words, None
        return additive_masks(words, self.vocab_size, device)

    def allowed_tokens(self) -> torch.Tensor:
        """Bool [vocab_size]: which tokens the grammar allows next (debugging and tests)."""
        return self.next_mask() == 0

    def _compute_mask(self) -> None:
        t0 = time.perf_counter()
        # NOTE: llguidance writes the bitmask straight into our buffer and drops the GIL meanwhile.
        self._ll.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        self._mask_ready = True
        self.last_mask_s = time.perf_counter() - t0

    def _wait(self) -> None:
        """Wait for an in-flight mask: llguidance state must not be read while it is computed."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def _settle(self) -> None:
        """Wait for an in-flight mask, then mark it stale: the state is about to change."""
        self._wait()
        self._mask_ready = False

    # ------------------------------------------------------------------ state changes

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token. False = the grammar refused it (see `error`)."""
        token_id = int(token_id)
        self._settle()
        if token_id in self.eos_token_ids and self._ll.is_stopped() and not self._ll.is_error():
            self._recorded.append(False)  # llguidance ignores EOS once stopped
            return True
        ok = self._ll.consume_token(token_id)
        if ok:
            self._recorded.append(True)
        return ok

    def accept_tokens(self, token_ids: Sequence[int]) -> bool:
        """Accept several tokens (e.g. fast-forwarded ones); stops at the first refused one."""
        return all(self.accept(t) for t in token_ids)

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens (n <= tokens accepted). Cannot undo an error state."""
        if n < 0 or n > len(self._recorded):
            raise ValueError(f"cannot roll back {n} of {len(self._recorded)} tokens")
        if n == 0:
            return
        self._settle()
        undone = self._recorded[-n:]
        del self._recorded[-n:]
        k = sum(undone)
        if k and not self._ll.rollback(k):
            raise RuntimeError(f"llguidance rollback failed: {self.error}")

    def draft_prefix(self, token_ids: Sequence[int], *, stop_at_forced: bool = True) -> tuple[int, bool]:
        """How many drafted tokens may go to verification, and whether the last of them ends
        at a point where decoding without a draft would not sample the next token.

        The prefix the grammar accepts, cut after the first token that completes the grammar
        or (with `stop_at_forced`) after which it forces tokens: those are fast-forwarded, as
        without speculation. The tokens are consumed to check them, then rolled back: the
        state is unchanged.
        """
        self._settle()
        tokens = [int(t) for t in token_ids]
        valid = self._ll.validate_tokens(tokens) if tokens else 0
        n, ends = 0, False
        for token in tokens[:valid]:
            if not self._ll.consume_token(token):  # validated: never, but never leave it consumed
                break
            n += 1
            if self._ll.is_stopped() or (stop_at_forced and self._fast_forward and self._ll.compute_ff_tokens()):
                ends = True
                break
        if n and not self._ll.rollback(n):
            raise RuntimeError(f"llguidance rollback failed: {self.error}")
        return n, ends

    def fast_forward_tokens(self) -> list[int]:
        """Tokens the grammar forces next (not yet accepted: the engine accepts and feeds them).

        Empty when nothing is forced, the sequence is finished, or the tokenizer is not
        canonical (then forced tokens could differ from the model's own tokenization).
        """
        self._wait()
        if not self._fast_forward or self._ll.is_stopped():
            return []
        return list(self._ll.compute_ff_tokens())

    # ------------------------------------------------------------------ queries

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (or EOS was accepted): finish without another forward pass."""
        self._wait()
        return self._ll.is_stopped() and not self._ll.is_error()

    @property
    def is_accepting(self) -> bool:
        """The output so far is a complete match: EOS is allowed now."""
        self._wait()
        return self._ll.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher failed (one line), or None."""
        self._wait()
        err = self._ll.get_error()
        if not err:
            return None
        return " ".join(err.replace("<non-verbose/>", "").split())

    @property
    def stop_reason(self) -> str:
        """llguidance's stop reason: "NotStopped", "NoExtension", "EndOfSentence", ..."""
        self._wait()
        return self._ll.stop_reason()

    @property
    def num_accepted(self) -> int:
        return len(self._recorded)

