"""uvicorn, draining on SIGTERM: the server `kvserve serve` runs (server/cli.py)."""

from __future__ import annotations

import asyncio
import logging
import time

import uvicorn

log = logging.getLogger("kvserve.shutdown")

FLUSH_S = 5.0
"""After the drain, how long uvicorn waits for the last responses to reach their clients."""


class DrainingServer(uvicorn.Server):
    """uvicorn, but SIGTERM drains before the listening socket closes.

    Plain uvicorn closes the socket on SIGTERM and re-raises the signal once shut down (exit
    status 143). Here the first SIGTERM or SIGINT only marks the app as draining: /ready and new
    requests answer 503 (with Retry-After) at once, /health stays 200, admitted requests run
    on. Once the engine holds no request, or `grace_s` after the signal, uvicorn's own shutdown
    runs: requests still in the engine are aborted, the last responses are flushed (`FLUSH_S`),
    the lifespan stops the engine, and the process exits 0. A second signal ends the drain now.
    """

    def __init__(self, config: uvicorn.Config, state, grace_s: float) -> None:
        super().__init__(config)
        self.state = state  # server.api.app.AppState
        self.grace_s = grace_s
        self.drain_started: float | None = None
        self._announced = False

    def handle_exit(self, sig: int, frame) -> None:
        # NOTE: runs as a signal handler: only set flags here. Unlike uvicorn's handler, this
        # does not record the signal, so uvicorn does not re-raise it after the shutdown.
        if self.drain_started is None:
            self.drain_started = time.monotonic()
            self.state.draining = True
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        """Every 0.1 s: exit once the server cannot serve (nothing is left to drain: the
        engine failed its requests); while draining, once the engine is idle or the grace is
        over."""
        if self.state.fatal is not None and not self.should_exit:
            self.should_exit = True
        if self.drain_started is not None and not self.should_exit:
            self.should_exit = self._drain_done()
        return await super().on_tick(counter)

    def _drain_done(self) -> bool:
        if self.state.drain():
            log.info("drained: no request in flight, shutting down")
            return True
        if time.monotonic() - self.drain_started >= self.grace_s:
            log.warning("shutdown grace period of %g s is over: aborting the requests in flight", self.grace_s)
            return True
        if not self._announced:
            self._announced = True
            log.info("draining: waiting up to %g s for the requests in flight (signal again to stop now)", self.grace_s)
        return False

    async def shutdown(self, sockets=None) -> None:
        # NOTE: abort what is left before uvicorn waits for open connections, so those
        # responses end now instead of holding the wait until FLUSH_S.
        if not self.state.drain():
            await asyncio.to_thread(self.state.abort_in_flight)
        await super().shutdown(sockets)
