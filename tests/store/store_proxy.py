"""A loopback TCP proxy that can cut every connection once a byte budget is spent: a
real broken stream between a gRPC client and server, without touching either."""
from __future__ import annotations

import socket
import threading


class CuttingProxy:
    def __init__(self, target_port: int, cut_after_bytes: int | None = None) -> None:
        self.target_port = target_port
        self.cut_after_bytes = cut_after_bytes  # server->client bytes before the (single) cut
        self.forwarded = 0
        self.cuts = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, downstream: bool) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if downstream:
                    with self._lock:
                        self.forwarded += len(data)
                        cut = self.cut_after_bytes is not None and self.forwarded >= self.cut_after_bytes
                        if cut:
                            self.cut_after_bytes = None
                            self.cuts += 1
                    if cut:
                        self.cut_all()
                        return
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.cut_all()
