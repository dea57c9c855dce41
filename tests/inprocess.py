"""The official openai client on an in-process app (no socket, no uvicorn): how the tests of
tiny random-weight models talk to kvserve."""

from __future__ import annotations

import contextlib

import anyio
import httpx
from openai import AsyncOpenAI

from tests.device import SETTINGS


@contextlib.asynccontextmanager
async def openai_client(loaded, **settings):
    """`async with openai_client(loaded, **settings) as (client, http)`: an app serving the
    `LoadedModel` with those settings, ready; the AsyncOpenAI client and the raw httpx client."""
    from asgi_lifespan import LifespanManager

    from server.startup import create_app
    from server.settings import Settings

    app = create_app(Settings(**{**SETTINGS, **settings}), loaded=loaded)
    async with LifespanManager(app) as manager:
        transport = httpx.ASGITransport(app=manager.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://kvserve", timeout=120) as http:
            while (await http.get("/ready")).status_code != 200:
                await anyio.sleep(0.05)
            yield AsyncOpenAI(base_url="http://kvserve/v1", api_key="x", http_client=http, max_retries=0), http


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
