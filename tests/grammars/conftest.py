"""Grammar fixtures: one compiler for the SmolLM2 tokenizer, and a greedy text -> tokens walker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from grammars import GrammarCompiler, Matcher

VOCAB_SIZE = 49152  # SmolLM2's logits width
EOS = 2  # <|im_end|>

# The 144 JSONSchemaBench schemas, found from this file, never from the cwd: in ../shared beside
# the checkout (CI, a developer's machine), else in a shared/ inside it (what travels to a
# GPU machine, which gets the checkout alone). Skipped only where neither exists, never in CI.
REPO = Path(__file__).resolve().parents[2]
_BENCH_DIRS = [root / "shared" / "data" / "jsonschemabench" for root in (REPO.parent, REPO)]
JSONSCHEMABENCH = next((d for d in _BENCH_DIRS if d.is_dir()), _BENCH_DIRS[0])
needs_jsonschemabench = pytest.mark.skipif(
    not JSONSCHEMABENCH.is_dir() and os.environ.get("CI", "").lower() != "true",
    reason=f"no JSONSchemaBench data: neither {' nor '.join(map(str, _BENCH_DIRS))} exists",
)


@pytest.fixture(scope="session")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB_SIZE)


@pytest.fixture(scope="session")
def token_of_bytes(compiler) -> dict[bytes, int]:
    """Decoded bytes -> token id, for every non-special token (first id wins)."""
    llt = compiler.ll_tokenizer
    table: dict[bytes, int] = {}
    for i in range(VOCAB_SIZE):
        if not llt.is_special_token(i):
            table.setdefault(llt.decode_bytes([i]), i)
    return table


@pytest.fixture(scope="session")
def walk(token_of_bytes):
    """Drive a matcher through `text`: at each step accept the longest allowed token that
    continues the text (the grammar's mask decides, not the tokenizer's own split)."""

    def walk(m: Matcher, text: str) -> list[int]:
        rest, ids = text.encode(), []
        while rest:
            allowed = m.allowed_tokens()
            for n in range(min(len(rest), 64), 0, -1):
                tid = token_of_bytes.get(rest[:n])
                if tid is not None and allowed[tid]:
                    break
            else:
                raise AssertionError(f"no allowed token continues {rest[:20]!r}")
            assert m.accept(tid), m.error
            ids.append(tid)
            rest = rest[n:]
        return ids

    return walk
