"""Hand-rolled ZMTP 3.0 peers and a recording TCP relay, for attacking the side channel below ZeroMQ's API.

ZeroMQ's own sockets never put an unfinished multipart message on the wire (a sender flushes a message only
once its last frame is written), so the attacks on a victim's buffering speak ZMTP over a plain TCP socket:
the NULL-mechanism greeting, a ``READY`` command, then frames that all carry the MORE flag.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable

FRAME = 256 << 10
"""Bytes per frame of a flood (below every side-channel ``MAXMSGSIZE``)."""


def greeting(as_server: bool) -> bytes:
    """A ZMTP 3.0 greeting announcing the NULL mechanism (no security)."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes([as_server]) + bytes(31)


def ready(socket_type: bytes) -> bytes:
    """A ZMTP ``READY`` command frame declaring ``socket_type``."""
    body = b"\x05READY" + bytes([len(b"Socket-Type")]) + b"Socket-Type" + struct.pack(">I", len(socket_type))
    body += socket_type
    return bytes([0x04, len(body)]) + body


def more_frame(size: int) -> bytes:
    """One long data frame of ``size`` bytes with the MORE flag: the message never ends."""
    return b"\x03" + struct.pack(">Q", size) + b"x" * size


class Flood:
    """Sends an unfinished multipart message of up to ``total`` bytes over ``conn`` after the NULL handshake.

    Records how many bytes the victim accepted before it closed the connection (``sent``) and whether it did
    (``refused``).
    """

    def __init__(self, conn: socket.socket, total: int, socket_type: bytes) -> None:
        self.conn = conn
        self.total = total
        self.socket_type = socket_type
        self.sent = 0
        self.refused = False

    def run(self) -> None:
        frame = more_frame(FRAME)
        try:
            self.conn.sendall(greeting(as_server=self.socket_type == b"ROUTER") + ready(self.socket_type))
            while self.sent < self.total:
                self.conn.sendall(frame)
                self.sent += len(frame)
        except OSError:  # reset or broken pipe: the victim hung up
            self.refused = True


def flood_server(address: str, total: int) -> Flood:
    """Connect to the ROUTER at ``tcp://HOST:PORT`` as a DEALER and float ``total`` bytes of one message."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=10.0)
    flood = Flood(conn, total, b"DEALER")
    try:
        flood.run()
        if not flood.refused:
            time.sleep(0.5)  # let the victim's I/O thread take in what is still in flight
    finally:
        conn.close()
    return flood


class HostileServer:
    """A TCP listener on 127.0.0.1 that answers every ZMTP client with an endless multipart reply."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.floods: list[Flood] = []
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self._listener.settimeout(0.1)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(10.0)
            flood = Flood(conn, self.total, b"ROUTER")
            self.floods.append(flood)
            try:
                flood.run()
            finally:
                conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(15.0)
        self._listener.close()


class Relay:
    """A TCP relay on 127.0.0.1 in front of ``target`` that records every byte in both directions.

    ``tee``: another ``tcp://HOST:PORT`` that also receives a copy of everything the client sends (what an
    on-path attacker delivering one message to two servers does); its answers are discarded.
    """

    def __init__(self, target: str, tee: str | None = None) -> None:
        self.target = target
        self.tee = tee
        self.upstream = bytearray()  # client -> server
        self.downstream = bytearray()  # server -> client
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(8)
        self._listener.settimeout(0.1)
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            server = _dial(self.target)
            copies = [server] + ([_dial(self.tee)] if self.tee is not None else [])
            self._pump(client, copies, self.upstream)
            self._pump(server, [client], self.downstream)
            if len(copies) > 1:
                self._pump(copies[1], [], bytearray())  # the tee's answers go nowhere

    def _pump(self, src: socket.socket, dsts: list[socket.socket], record: bytearray) -> None:
        def run() -> None:
            try:
                while not self._stop.is_set():
                    try:
                        data = src.recv(1 << 16)
                    except TimeoutError:
                        continue
                    if not data:
                        break
                    record.extend(data)
                    for dst in dsts:
                        try:
                            dst.sendall(data)
                        except OSError:
                            pass
            except OSError:
                pass
            finally:
                for s in (src, *dsts):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

        src.settimeout(0.1)
        t = threading.Thread(target=run, daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for t in self._threads:
            t.join(5.0)
        self._listener.close()


def _dial(address: str) -> socket.socket:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5.0)


def replay(address: str, recorded: bytes, wait_s: float = 1.0) -> bytes:
    """Send ``recorded`` (a client's bytes captured earlier) into a new connection to ``address`` as a client
    would (signature, rest of the greeting, then everything else, each after the server's answer); what came
    back."""
    got = bytearray()
    with _dial(address) as conn:
        conn.settimeout(0.1)
        for chunk in (recorded[:10], recorded[10:64], recorded[64:]):
            try:
                conn.sendall(chunk)
            except OSError:
                break
            end = time.monotonic() + (0.2 if len(chunk) <= 54 else wait_s)
            while time.monotonic() < end:
                try:
                    data = conn.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    return bytes(got)
                if not data:
                    return bytes(got)
                got += data
    return bytes(got)


def peak_rss_growth() -> Callable[[], int]:
    """Reset this process's peak RSS (``VmHWM``); the returned function gives how far the peak rose above the
    RSS at the reset (transient buffers count even after they were freed)."""

    def status(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    base = status("VmRSS")
    return lambda: status("VmHWM") - base
