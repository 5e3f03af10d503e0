"""uvicorn as `jaxllm serve` runs it: slow-client timeouts, graceful signals, engine watchdog.

- SIGTERM/SIGINT stop accepting connections, let in-flight requests finish for up to
  --shutdown-timeout seconds, then fail the rest with an error (503; in-band for streams) and
  abort them in the engine, and end the process with exit code 0. (uvicorn re-raises the
  signal once done, which exits -15; its own cancel, which would cut responses without a
  word, only backs ours up a few seconds later.)
- A connection that has not sent a complete request head --http-read-timeout seconds after
  it opened or after its last response is closed (slowloris); a head h11 refuses (malformed,
  or over --h11-max-incomplete-event-size) gets an OpenAI-shaped 400.
- If the engine loop dies, the server shuts down and the process exits 1, for a supervisor to
  restart it (see jaxllm/engine/async_engine.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.errors import error_body

logger = logging.getLogger("jaxllm.serving")


def h11_protocol(read_timeout: float) -> type:
    """uvicorn's h11 protocol, closing connections whose request head is too slow to come."""

    class Protocol(H11Protocol):
        _head_timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm_head_timer()

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

        def _arm_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(read_timeout, self._head_timeout)

        def send_400_response(self, msg: str) -> None:
            """h11 refused the request head: say so in OpenAI's error shape, not plain text."""
            body = json.dumps(error_body(
                "Invalid HTTP request: malformed, or its head is larger than "
                "--h11-max-incomplete-event-size.", 400)).encode()
            for event in (h11.Response(status_code=400, reason=b"Bad Request", headers=[
                    (b"content-type", b"application/json"), (b"connection", b"close")]),
                    h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
            self.transport.close()

        def _head_timeout(self) -> None:
            in_request = self.cycle is not None and not self.cycle.response_complete
            if not in_request and not self.transport.is_closing():
                self.transport.close()

    return Protocol


class Server(uvicorn.Server):
    """uvicorn.Server whose signals end a graceful shutdown without being re-raised."""

    engine_failed = False

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:  # a second signal: stop waiting for in-flight requests
            self.force_exit = True
        else:
            logger.info("Signal %d: draining in-flight requests (at most %g s), then exiting",
                        sig, self.config.timeout_graceful_shutdown)
        self.should_exit = True

    async def cancel_after_shutdown_timeout(self, engine, timeout: float) -> None:
        """Once a shutdown starts, give in-flight requests `timeout` seconds, then fail them."""
        while not self.should_exit:
            await asyncio.sleep(0.1)
        await asyncio.sleep(timeout)
        n = engine.cancel_all(f"The server is shutting down and the request did not finish "
                              f"within --shutdown-timeout ({timeout:g} s).")
        if n:
            logger.warning("Shutdown timeout: cancelled %d request(s) still in flight", n)

    async def watch_engine(self, engine, period: float = 0.5) -> None:
        """Shut the server down once the engine loop has died."""
        while engine.is_running:
            await asyncio.sleep(period)
        logger.error("The engine loop died: shutting the server down (exit code 1).")
        self.engine_failed = True
        self.should_exit = True
