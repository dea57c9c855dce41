"""Liveness, readiness, version and Prometheus metrics."""

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from server import __version__

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """200 while the process can serve (even while the model loads); 503 once it cannot (the
    model failed to start, or the engine died) until the process exits."""
    if request.app.state.kv.fatal is not None:
        return _unavailable("the server cannot serve: the model failed to start or stopped running; it is exiting")
    return JSONResponse({"status": "ok"})


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 once the model is loaded and warmed up; 503 before, and again while shutting down."""
    state = request.app.state.kv
    if state.ready:
        return JSONResponse({"status": "ready", "model": state.ctx.model_id})
    if state.draining:
        reason = "shutting down"
    elif state.fatal is not None:
        reason = "the model failed to load or stopped running; the server log says why"  # no paths in responses
    else:
        reason = "loading"
    return _unavailable(reason)


def _unavailable(reason: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": reason, "type": "service_unavailable", "param": None, "code": "not_ready"}},
        status_code=503,
        headers={"Retry-After": "5"},
    )


@router.get("/version")
async def version() -> dict:
    return {"version": __version__}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    m = request.app.state.kv.metrics
    return Response(m.render(), media_type=m.content_type)
