"""The caller's own sessions: list them, delete one (frees its KV cache).

Which sessions are "the caller's own":

* With API keys: every session of the caller's key (its principal), named or anonymous.
* Without API keys every caller shares one principal, so the session id is the only secret:
  a caller sees and deletes only the session whose id it presents in `X-Session-ID`. GET lists
  that one session (nothing without the header); DELETE needs the header to equal the id in
  the path, else 404 like a session that does not exist (existence is never revealed).

Ids are whatever the API accepts as `prompt_cache_key` (1-256 characters, `/` included), so
the DELETE path takes the rest of the path as the id: `team%2Falice` and `team/alice` both
name the session "team/alice".
"""

import time

from fastapi import APIRouter, Request, Response

from cache_manager.sessions import EntryPinnedError, is_anonymous
from server.api.errors import APIError
from server.api.middleware import ANONYMOUS

router = APIRouter()


def _presented(request: Request) -> str | None:
    """Without API keys: the `X-Session-ID` the caller presents (None: none presented).
    With keys: None, the caller's key already says which sessions are its own."""
    if request.state.principal != ANONYMOUS:
        return None
    return request.headers.get("x-session-id") or ""


@router.get("/v1/sessions")
async def list_sessions(request: Request) -> dict:
    """Sessions of the caller's API key only, most recently used first (without keys: only
    the session named by `X-Session-ID`), each with the tier its KV lives in: device, host
    (memory) or disk, and the model that computed it: the served model or a LoRA adapter (a
    session id used with two adapters is two sessions; DELETE removes both)."""
    ctx = request.app.state.kv.require_ctx()
    wall_offset = time.time() - time.monotonic()
    entries = [(model, e) for model, scoped in ctx.session_scopes(request.state.principal) for e in ctx.cache_manager.list_sessions(scoped)]
    entries.sort(key=lambda me: me[1].last_used, reverse=True)
    presented = _presented(request)
    if presented is not None:
        entries = [(model, e) for model, e in entries if e.session_id == presented]
    return {
        "object": "list",
        "data": [
            {
                "id": e.session_id,
                "object": "session",
                "model": model,
                "anonymous": is_anonymous(e.session_id),
                "tier": e.tier,
                "tokens": e.tokens,
                "bytes": e.nbytes,
                "in_flight": e.in_flight,
                "last_used_at": int(e.last_used + wall_offset),
            }
            for model, e in entries
        ],
    }


@router.delete("/v1/sessions/{session_id:path}")
async def delete_session(session_id: str, request: Request) -> Response:
    ctx = request.app.state.kv.require_ctx()
    presented = _presented(request)
    if presented is not None and presented != session_id:
        raise APIError(
            404,
            f"no session {session_id!r} for this caller: without API keys, delete a session by "
            "presenting its id in the X-Session-ID header as well",
            code="session_not_found", param="session_id",
        )
    try:
        deleted = ctx.delete_session(request.state.principal, session_id)
    except EntryPinnedError:
        raise APIError(409, f"session {session_id!r} has a request in flight", code="session_busy") from None
    if not deleted:
        raise APIError(404, f"no session {session_id!r}", code="session_not_found", param="session_id")
    return Response(status_code=204)
