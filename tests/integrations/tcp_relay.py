"""``TcpRelay``: relays TCP connections from a free local port to a target, holding chosen ones (a slow or
lossy network between two engines' side channels, in one process)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable


class TcpRelay:
    """Relays connections to ``target``; connection ``n`` (from 1) waits ``hold(n)`` seconds before it is
    relayed, or, where ``hold(n)`` is ``None``, is accepted and never relayed (its messages are lost)."""

    def __init__(self, target: tuple[str, int], hold: Callable[[int], float | None]) -> None:
        self.target, self.hold = target, hold
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        self.sock.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            hold = self.hold(self.accepted)
            if hold is None:
                self._held.append(client)  # open, never answered
                continue
            threading.Thread(target=self._relay, args=(client, hold), daemon=True).start()

    def _relay(self, client: socket.socket, hold: float) -> None:
        time.sleep(hold)
        try:
            upstream = socket.create_connection(self.target)
        except OSError:
            client.close()
            return
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
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
        self._stop.set()
        self.sock.close()
        for s in self._held:
            s.close()
