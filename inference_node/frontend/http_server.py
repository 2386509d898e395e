"""uvicorn serving an ASGI app on a front end's own event loop, beside its gRPC server.

The socket is bound here, not by uvicorn: several front-end processes bind the same port
with SO_REUSEPORT (the kernel spreads connections over them, as for gRPC), and a lone front
end binds it exclusively, so a second node on the port fails at start. The node decides
when to stop (signals stay the launcher's), so uvicorn's own signal handling is left out.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import uvicorn

from lora_common.tls import ServerTLS

log = logging.getLogger(__name__)
BACKLOG = 2048


def bind_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A TCP socket bound to host:port (0 picks a free port); OSError names the address."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart over TIME_WAIT, not over a listener
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(False)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """The launcher owns SIGTERM/SIGINT (a drain of the whole node), not uvicorn."""
        yield


class HttpServer:
    """One front end's HTTP listener: `start` returns once it accepts connections."""

    def __init__(self, app, host: str, port: int, tls: ServerTLS, reuse_port: bool,
                 graceful_seconds: float = 2.0) -> None:
        self.sock = bind_socket(host, port, reuse_port)
        self.port = self.sock.getsockname()[1]
        self.scheme = "https" if tls.enabled else "http"
        self.url = f"{self.scheme}://{host}:{self.port}"
        tls_options = {}
        if tls.enabled:
            tls.credentials()  # an incomplete or unreadable setting fails here with its flag named
            tls_options = {"ssl_certfile": tls.cert, "ssl_keyfile": tls.key}
            if tls.client_ca:
                tls_options |= {"ssl_ca_certs": tls.client_ca, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False, server_header=False,
                                proxy_headers=False, backlog=BACKLOG,
                                timeout_graceful_shutdown=graceful_seconds, **tls_options)
        self.server = _Server(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():  # it failed to start: raise its error
                self.task.result()
                raise RuntimeError(f"the HTTP server on {self.url} stopped while starting")
            await asyncio.sleep(0.01)
        log.info("OpenAI-compatible HTTP API on %s/v1", self.url)

    async def stop(self) -> None:
        """Closes the listener and open connections (the caller has let requests finish)."""
        if self.task is None:
            self.sock.close()
            return
        self.server.should_exit = True
        try:
            await self.task
        except Exception:
            log.exception("the HTTP server failed while stopping")
        self.sock.close()
