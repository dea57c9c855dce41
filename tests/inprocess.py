"""The official openai client on an in-process app (no socket, no uvicorn): how the tests of
tiny random-weight models talk to kvserve.

Every app served here sits behind a `conformance.Recorder`: each generation response a test
gets is also checked against the official SDKs' typed models and the stream rules
(tests/conformance.py), and the test fails at the app's end if one did not conform."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import anyio
import httpx
from openai import AsyncOpenAI

from tests.conformance import Recorder
from tests.device import SETTINGS


@dataclass(frozen=True)
class Served:
    """An app being served in-process: the FastAPI app (its state), the ASGI app its lifespan
    wraps (what a transport calls), a raw httpx client on it, and the `Recorder` in front."""

    app: object
    asgi: object
    http: httpx.AsyncClient
    recorder: Recorder


@contextlib.asynccontextmanager
async def served(loaded, **settings):
    """`async with served(loaded, **settings) as s`: an app serving the `LoadedModel` with those
    settings, ready (`Served`)."""
    from asgi_lifespan import LifespanManager

    from server.startup import create_app
    from server.settings import Settings

    app = create_app(Settings(**{**SETTINGS, **settings}), loaded=loaded)
    recorder = Recorder(app)
    async with LifespanManager(recorder) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve", timeout=120) as http:
            for _ in range(1200):
                if (await http.get("/ready")).status_code == 200:
                    break
                await anyio.sleep(0.05)
            else:
                raise RuntimeError("app never became ready")
            yield Served(app, manager.app, http, recorder)
    recorder.check()


@contextlib.asynccontextmanager
async def openai_client(loaded, **settings):
    """`async with openai_client(loaded, **settings) as (client, http)`: the AsyncOpenAI client
    and the raw httpx client on a `served` app."""
    async with served(loaded, **settings) as s:
        yield AsyncOpenAI(base_url="http://kvserve/v1", api_key="x", http_client=s.http, max_retries=0), s.http


async def ready_once_loaded(app) -> httpx.Response:
    """Run `app`'s lifespan until its load has failed (or 10 s passed); its /ready then."""
    from asgi_lifespan import LifespanManager

    async with LifespanManager(app) as manager:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=manager.app), base_url="http://kvserve") as client:
            for _ in range(200):
                if app.state.kv.load_error is not None:
                    break
                await anyio.sleep(0.05)
            return await client.get("/ready")


@contextlib.asynccontextmanager
async def anthropic_client(loaded, **settings):
    """`async with anthropic_client(loaded, **settings) as (client, http)`: as `openai_client`,
    with the official anthropic SDK (whose transport is httpx2's) on the same app."""
    import httpx2
    from anthropic import AsyncAnthropic

    async with served(loaded, **settings) as s:
        transport = httpx2.ASGITransport(app=s.asgi)
        async with httpx2.AsyncClient(transport=transport, base_url="http://kvserve", timeout=120) as http2:
            keys = settings.get("api_key") or ["x"]
            yield AsyncAnthropic(base_url="http://kvserve", api_key=keys[0], http_client=http2, max_retries=0), s.http
