"""What tests that drive an `Engine` directly share: a fixture body that builds engines (or
harnesses around them) on demand and stops each at teardown, and one request run to its end."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


def stopped_after(build: Callable[..., T]) -> Iterator[Callable[..., T]]:
    """Yields `make(*args, **kw)` -> `build(*args, **kw)`; then calls `stop()` on each made."""
    made: list = []

    def make(*args, **kw) -> T:
        made.append(build(*args, **kw))
        return made[-1]

    yield make
    for thing in made:
        thing.stop()


async def run(engine, request, cancel_after: int | None = None) -> tuple[list[int], object]:
    """(the token ids, the final output) of `request` on `engine`; with `cancel_after`, the
    request is cancelled once that many tokens arrived."""
    handle = engine.submit(request, asyncio.get_running_loop())
    tokens, final = [], None
    async for out in handle:
        tokens += [t.token_id for t in out.tokens]
        if cancel_after is not None and len(tokens) >= cancel_after:
            handle.cancel()
        final = out
    return tokens, final
