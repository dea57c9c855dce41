"""The caller's own sessions: list them, delete one (frees its KV cache)."""

import time

from fastapi import APIRouter, Request, Response

from cache_manager.sessions import EntryPinnedError, is_anonymous
from server.errors import APIError

router = APIRouter()


@router.get("/v1/sessions")
async def list_sessions(request: Request) -> dict:
    """Sessions of the caller's API key only, most recently used first."""
    ctx = request.app.state.kv.require_ctx()
    wall_offset = time.time() - time.monotonic()
    entries = ctx.cache_manager.list_sessions(request.state.principal)
    return {
        "object": "list",
        "data": [
            {
                "id": e.session_id,
                "object": "session",
                "anonymous": is_anonymous(e.session_id),
                "tokens": len(e.tokens),
                "bytes": e.nbytes,
                "in_flight": not e.idle,
                "last_used_at": int(e.last_used + wall_offset),
            }
            for e in entries
        ],
    }


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request) -> Response:
    ctx = request.app.state.kv.require_ctx()
    try:
        deleted = ctx.cache_manager.delete_session(request.state.principal, session_id)
    except EntryPinnedError:
        raise APIError(409, f"session {session_id!r} has a request in flight", code="session_busy") from None
    if not deleted:
        raise APIError(404, f"no session {session_id!r}", code="session_not_found", param="session_id")
    return Response(status_code=204)
