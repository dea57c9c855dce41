"""Token ids -> text deltas that never split a UTF-8 character, with stop strings.

`TextStream.push(token_id)` returns the text that is now safe to send: text that cannot still
turn out to be the start of a stop string, and no trailing half of a multi-byte character
(byte-level tokenizers decode those as U+FFFD until the rest arrives).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase
from transformers.tokenization_utils_tokenizers import TokenizersBackend


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest


def decoder(tokenizer, backend: Tokenizer | None) -> Callable[[list[int]], str]:
    """`tokenizer.decode(ids, skip_special_tokens=True)`, as a function chosen once. For a fast
    (Rust) tokenizer whose decode transformers does not post-process (`backend`: what `_rust`
    found; None: none), the Rust decode itself: the same text without transformers' per-call
    conversions, which cost about 5x the decode at every token of every row."""
    if backend is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _rust(tokenizer) -> Tokenizer | None:
    """The Rust tokenizer whose decode is `tokenizer.decode`'s text (`decoder`); None where
    transformers' decode is its own."""
    backend = getattr(tokenizer, "_tokenizer", None)
    plain = (
        isinstance(tokenizer, TokenizersBackend)
        and type(tokenizer).decode is PreTrainedTokenizerBase.decode
        and type(tokenizer)._decode is TokenizersBackend._decode
        and backend is not None
        and not _cleans_up(tokenizer, backend)
    )
    return backend if plain else None


def _cleans_up(tokenizer, backend) -> bool:
    """Whether transformers' `_decode` post-processes the text (`clean_up_tokenization`): when
    asked to, except for BPE models, where it ignores the ask unless forced."""
    if not tokenizer.clean_up_tokenization_spaces:
        return False
    bpe = type(backend.model).__name__ == "BPE"
    return not bpe or bool(getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))


@dataclass(slots=True)
class Delta:
    text: str
    stopped: bool = False  # a stop string matched; `text` ends right before it


class TextStream:
    """Incremental detokenizer for one sequence's generated tokens."""

    # NOTE: decoding a short window (prefix_offset..) instead of all tokens keeps each push
    # O(window); the window starts a few tokens back so that tokenizers whose pieces depend on
    # their left neighbour (leading-space handling) still decode the new piece correctly.
    # tokenizers' `DecodeStream` moves the same window in Rust, with one call a token instead
    # of two decodes (`_rust`): 0.7 us a token instead of 2.5 at every row of every step.

    def __init__(self, tokenizer, stops: tuple[str, ...] = ()) -> None:
        self._rust = _rust(tokenizer)
        self._decode = decoder(tokenizer, self._rust)
        self._stream = DecodeStream(skip_special_tokens=True) if self._rust is not None else None
        self._stops = tuple(s for s in stops if s)
        self._reach = max(map(len, self._stops), default=1) - 1  # sent characters a stop string may still start in
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._text = ""  # the decoded text not sent yet, after the last `_reach` characters sent
        self._sent = 0  # how much of _text has been handed out
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def _decode_new(self) -> str:
        """The text the newest token adds, once it decodes to whole characters ("" until then)."""
        if self._stream is not None:
            try:
                piece = self._stream.step(self._rust, self._ids[-1])
            except Exception:  # noqa: BLE001 - see the note
                # NOTE: DecodeStream refuses a window whose text does not start with the text
                # of its first tokens (a decoder that rewrites across tokens: `Replace`); the
                # window below takes the text past the prefix's length, as it always did. Its
                # offsets are the stream's until here; the stream is not used again.
                self._stream = None
            else:
                if piece is None:
                    return ""
                self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                return piece
        prefix = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full = self._decode(self._ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full[len(prefix) :]

    def push(self, token_id: int) -> Delta:
        if self.stopped:
            return Delta("", stopped=True)
        self._ids.append(token_id)
        self._text += self._decode_new()
        if self._stops:
            search_from = max(0, self._sent - self._reach)
            hits = [(i, s) for s in self._stops if (i := self._text.find(s, search_from)) >= 0]
            if hits:
                end, self.matched = min(hits)
                out = self._text[self._sent : end]
                self._sent = len(self._text)
                self.stopped = True
                return Delta(out, stopped=True)
        safe = len(self._text) - _held_back(self._text, self._stops)
        out = self._text[self._sent : safe]
        self._sent = max(self._sent, safe)
        # NOTE: `+=` above copies the whole text kept, at every token: what no stop string can
        # start in any more goes (a 32k-token answer cost 3.5 us a token, 2.4 at its start)
        if (drop := self._sent - self._reach) > 0:
            self._text, self._sent = self._text[drop:], self._sent - drop
        return Delta(out)

    def flush(self) -> str:
        """At the end of generation: whatever was held back (a stop-string prefix, say)."""
        if self.stopped:
            return ""
        rest = self._text[self._sent :]
        self._sent = len(self._text)
        return rest
