"""Loopback TCP proxies that break what a real server sends back, without touching either
end: one cuts every connection once a byte budget is spent (a broken gRPC stream), one
changes a byte of each connection's answer (storage rot or a faulty middlebox)."""
from __future__ import annotations

import socket
import threading


class LoopbackProxy:
    """Forwards each connection to target_port unchanged; subclasses see what flows back."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def passing_back(self, data: bytes, seen: int) -> tuple[bytes, bool]:
        """What to send back of `data`, which follows `seen` bytes of this connection's
        answer, and whether to cut every connection after it."""
        return data, False

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
                cut = False
                if downstream:
                    data, cut = self.passing_back(data, seen)
                seen += len(data)
                dst.sendall(data)
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


class CuttingProxy(LoopbackProxy):
    """Cuts every connection once, after cut_after_bytes have gone back over all of them."""

    def __init__(self, target_port: int, cut_after_bytes: int | None = None) -> None:
        self.cut_after_bytes = cut_after_bytes
        self.forwarded = 0
        self.cuts = 0
        super().__init__(target_port)

    def passing_back(self, data: bytes, seen: int) -> tuple[bytes, bool]:
        with self._lock:
            self.forwarded += len(data)
            cut = self.cut_after_bytes is not None and self.forwarded >= self.cut_after_bytes
            if cut:
                self.cut_after_bytes = None
                self.cuts += 1
        return data, cut


class CorruptingProxy(LoopbackProxy):
    """Flips byte flip_at of each connection's answer (past its first response's headers, for
    an HTTP server such as SeaweedFS's S3). Requests pass unchanged: their Host names the
    proxy, as the URLs presigned for it sign."""

    def __init__(self, target_port: int, flip_at: int = 8192) -> None:
        self.flip_at = flip_at
        self.flipped = 0
        super().__init__(target_port)

    def passing_back(self, data: bytes, seen: int) -> tuple[bytes, bool]:
        if seen <= self.flip_at < seen + len(data):
            at = self.flip_at - seen
            data = data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]
            with self._lock:
                self.flipped += 1
        return data, False
