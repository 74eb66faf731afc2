"""``TcpRelay``: relays TCP connections from a free local port to a target, holding chosen ones (a slow or
lossy network between two engines' side channels, in one process)."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable

ZMTP_GREETING_BYTES = 64


def zmtp_frames(buf: bytes) -> tuple[list[bytes], bytes]:
    """The complete ZMTP 3 frames at the start of ``buf`` (after the greeting), and what is left."""
    frames = []
    while buf:
        head = 9 if buf[0] & 0x02 else 2
        if len(buf) < head:
            break
        size = int.from_bytes(buf[1:head], "big")
        if len(buf) < head + size:
            break
        frames.append(buf[: head + size])
        buf = buf[head + size :]
    return frames, buf


def is_message(frame: bytes) -> bool:
    """Whether a ZMTP frame carries an (encrypted) message rather than a handshake command."""
    head = 9 if frame[0] & 0x02 else 2
    return frame[head:].startswith(b"\x07MESSAGE")


class ZmtpReplyDropper:
    """Filters a ZMTP 3 byte stream from a server to its client: the greeting and the handshake's commands
    (CURVE's WELCOME and READY) pass, every encrypted message (a frame whose body starts with ``MESSAGE``, the
    server's replies and acknowledgements) is dropped. The client completes its CURVE handshake and sends, and
    the server receives, but no acknowledgement ever comes back: a lossy network that loses only replies."""

    def __init__(self) -> None:
        self._buf = b""
        self._greeting_left = ZMTP_GREETING_BYTES
        self.dropped = 0

    def feed(self, data: bytes) -> bytes:
        """What of ``data`` (and what came before it) goes on to the client."""
        out = []
        if self._greeting_left:  # the greeting passes as it comes (ZeroMQ sends it in parts and waits for the peer's)
            head, data = data[: self._greeting_left], data[self._greeting_left :]
            out.append(head)
            self._greeting_left -= len(head)
        self._buf += data
        frames, self._buf = zmtp_frames(self._buf)
        for frame in frames:
            if is_message(frame):
                self.dropped += 1
            else:
                out.append(frame)
        return b"".join(out)


class TcpRelay:
    """Relays connections to ``target``; connection ``n`` (from 1) waits ``hold(n)`` seconds before it is
    relayed, or, where ``hold(n)`` is ``None``, is accepted and never relayed (its messages are lost).
    ``drop_replies``: relayed connections carry everything to the target but only the ZMTP handshake back
    (``ZmtpReplyDropper``): every message arrives, no acknowledgement does. ``delay_requests``: every message
    the client sends reaches the target this many seconds late (the handshake at once, so the connection and its
    session stay up however long the client waits), even when the client gave up and hung up meanwhile."""

    def __init__(
        self,
        target: tuple[str, int],
        hold: Callable[[int], float | None],
        *,
        drop_replies: bool = False,
        delay_requests: float = 0.0,
    ) -> None:
        self.target, self.hold = target, hold
        self.drop_replies = drop_replies
        self.delay_requests = delay_requests
        self.dropped_replies = 0
        self.delayed_requests = 0
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
        back = ZmtpReplyDropper() if self.drop_replies else None
        forth = self._pump_delayed if self.delay_requests else self._pump
        threading.Thread(target=forth, args=(client, upstream), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, back), daemon=True).start()

    def _pump_delayed(self, src: socket.socket, dst: socket.socket) -> None:
        """Client to target, each message ``delay_requests`` late, in order; the target's side stays open until
        the last one went."""
        out: queue.SimpleQueue[tuple[float, bytes] | None] = queue.SimpleQueue()

        def send() -> None:
            try:
                while (item := out.get()) is not None:
                    due, data = item
                    time.sleep(max(0.0, due - time.monotonic()))
                    dst.sendall(data)
                time.sleep(self.delay_requests)  # the target's acknowledgements go nowhere: let it answer
            except OSError:
                pass
            finally:
                dst.close()

        threading.Thread(target=send, daemon=True).start()
        buf, greeting_left = b"", ZMTP_GREETING_BYTES
        try:
            while data := src.recv(65536):
                if greeting_left:  # as it comes: ZeroMQ sends its greeting in parts and waits for the peer's
                    head, data = data[:greeting_left], data[greeting_left:]
                    out.put((time.monotonic(), head))
                    greeting_left -= len(head)
                buf += data
                frames, buf = zmtp_frames(buf)
                for frame in frames:
                    late = is_message(frame)
                    self.delayed_requests += late
                    out.put((time.monotonic() + (self.delay_requests if late else 0.0), frame))
        except OSError:
            pass
        finally:
            out.put(None)

    def _pump(self, src: socket.socket, dst: socket.socket, dropper: ZmtpReplyDropper | None = None) -> None:
        try:
            while data := src.recv(65536):
                if dropper is not None:
                    before = dropper.dropped
                    data = dropper.feed(data)
                    self.dropped_replies += dropper.dropped - before
                if data:
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
