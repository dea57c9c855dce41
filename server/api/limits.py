"""Bounded work per request: what one request may ask of the server, checked before it is queued.

**Work.** A request generates up to `prompts × n × max_tokens` tokens, and with top logprobs each
token comes back as `1 + top_logprobs` entries, every one a token decoded to text on the event
loop. `Work` counts the product against `--max-request-tokens` (unset: `CONTEXTS_OF_WORK` × the
context): a request over it is a 400 `request_too_large` naming the field to lower, the first
of `top_logprobs`, `n`, `prompt` whose minimum alone would fit, else the max-tokens field. A
request that left max_tokens unset is not refused for the server's default: the default is
lowered to fit (`Work.default_max_tokens`).

**Prompt length.** `prompt_ids` tokenizes a prompt exactly, except one far longer than the
context: a text of more than `WHOLE_CHARS_PER_TOKEN` characters per context token is first
tokenized by growing prefixes, and refused (400 `context_length_exceeded` naming the prompt's
field) once a prefix alone fills the context, so a body far longer than the context costs the
tokenizing of a few contexts' worth of text, not of the whole body.

The sizes of a request's fields (tools, schemas, stop strings) are the wire models' bounds:
server/api/protocol.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.api.errors import APIError

CONTEXTS_OF_WORK = 8
WHOLE_CHARS_PER_TOKEN = 4  # texts up to this many characters per context token are tokenized whole
FIRST_PREFIX_CHARS_PER_TOKEN = 2
PREFIX_GROWTH = 4
# NOTE: a prefix is cut before a whitespace where it can be, so its tokens are the whole text's
# first tokens (pre-tokenizers split there); the margin covers tokenizers that merge across it.
PREFIX_MARGIN_TOKENS = 64
_BLANKS = (" ", "\n", "\t")


def work_limit(max_request_tokens: int | None, max_context: int) -> int:
    """The per-request work bound: `--max-request-tokens`, else `CONTEXTS_OF_WORK` contexts."""
    return max_request_tokens if max_request_tokens is not None else CONTEXTS_OF_WORK * max_context


@dataclass(frozen=True, slots=True)
class Work:
    """What one request asks per generated token, and its fields' names for the 400."""

    prompts: int
    n: int
    top_logprobs: int
    max_tokens_param: str = "max_tokens"
    logprobs_param: str = "top_logprobs"

    @property
    def per_token(self) -> int:
        """Work units per token of max_tokens: one per sequence, times its logprob entries."""
        return self.prompts * self.n * (1 + self.top_logprobs)

    def default_max_tokens(self, limit: int, default: int) -> int:
        """The server's default max_tokens lowered to fit `limit` (at least 1: `check` then
        refuses what even one token per sequence exceeds)."""
        return max(1, min(default, limit // self.per_token))

    def check(self, limit: int, max_tokens: int) -> None:
        """400 `request_too_large` when `max_tokens` per sequence exceeds `limit`."""
        total = self.per_token * max_tokens
        if total <= limit:
            return
        param = self.max_tokens_param
        for field, smaller in ((self.logprobs_param, Work(self.prompts, self.n, 0)),
                               ("n", Work(self.prompts, 1, self.top_logprobs)),
                               ("prompt", Work(1, self.n, self.top_logprobs))):
            if smaller.per_token < self.per_token and smaller.per_token * max_tokens <= limit:
                param = field
                break
        raise APIError(
            400,
            f"this request asks for {total} tokens of work: {self.prompts} prompt(s) x n={self.n} x "
            f"{self.max_tokens_param}={max_tokens} x (1 + {self.logprobs_param}={self.top_logprobs}); the "
            f"server allows {limit} per request (--max-request-tokens). Lower {param}.",
            code="request_too_large", param=param, rejection="too_large",
        )


def context_exceeded(max_context: int, holds: str, reduce: str, param: str | None) -> APIError:
    """The one 400 `context_length_exceeded`, in OpenAI's words: what the request `holds` and
    what to `reduce`, naming `param`."""
    return APIError(
        400, f"This model's maximum context length is {max_context} tokens. However, {holds}. Please reduce {reduce}.",
        code="context_length_exceeded", param=param, rejection="too_long",
    )


def prompt_ids(tokenizer, text: str, max_context: int, param: str, **kwargs) -> list[int]:
    """`tokenizer(text, **kwargs)["input_ids"]` for a text that may fit the context (the same
    ids, whatever its length); a 400 `context_length_exceeded` naming `param` as soon as a
    prefix of a long text alone fills the context. Blocking: call it off the event loop."""
    if len(text) > WHOLE_CHARS_PER_TOKEN * max_context:
        size = FIRST_PREFIX_CHARS_PER_TOKEN * max_context
        while size < len(text):
            cut = _cut(text, size)
            counted = len(tokenizer(text[:cut], **kwargs)["input_ids"]) - PREFIX_MARGIN_TOKENS
            if counted >= max_context:
                raise context_exceeded(max_context, f"the prompt holds more than {counted} tokens (counted in its first "
                                       f"{cut} of {len(text)} characters)", f"the length of the {param}", param)
            size *= PREFIX_GROWTH
    return tokenizer(text, **kwargs)["input_ids"]


def _cut(text: str, size: int) -> int:
    """Where a prefix of about `size` characters ends: before the last whitespace of its last
    quarter, else at `size`."""
    blank = max(text.rfind(b, size - size // 4, size) for b in _BLANKS)
    return blank if blank > 0 else size
