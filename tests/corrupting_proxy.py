"""A loopback TCP proxy in front of an HTTP server (SeaweedFS's S3) that changes one byte of
what each connection sends back, past its first response's headers: bytes that differ from
what the store's catalog digested, as storage rot or a faulty middlebox would deliver them.
Requests pass unchanged (their Host names the proxy, as the URLs presigned for it sign)."""
from __future__ import annotations

import socket
import threading


class CorruptingProxy:
    def __init__(self, target_port: int, flip_at: int = 8192) -> None:
        self.target_port = target_port
        self.flip_at = flip_at  # which downstream byte of each connection is changed
        self.flipped = 0
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
        seen = 0
        try:
            while data := src.recv(65536):
                if downstream and seen <= self.flip_at < seen + len(data):
                    at = self.flip_at - seen
                    data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
                    with self._lock:
                        self.flipped += 1
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.close()
            except OSError:
                pass
