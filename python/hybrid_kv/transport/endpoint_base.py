"""What every part of an ``Endpoint`` shares: its state, its lock, and the ``locked`` decorator that takes it.

``Endpoint`` (``endpoint``) is assembled from parts, one concept each: the connections to peers
(``endpoint_peers``), the requests (``endpoint_requests``), and its own lifecycle, local table scopes and
control messages. Every method that calls into the NIXL agent runs under the endpoint's lock (``locked``).
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import zmq

from ..errors import TransferError
from .agent import Agent
from .channel_process import SideChannelProcess
from .channel_server import SideChannelServer
from .courier import Courier
from .inbox import Inbox
from .inflight import InFlight
from .peers import Peers
from .requests import ControlMessage

__all__ = ["EndpointBase", "locked"]

_P = ParamSpec("_P")
_R = TypeVar("_R")
_E = TypeVar("_E", bound="EndpointBase")


def locked(fn: Callable[Concatenate[_E, _P], _R]) -> Callable[Concatenate[_E, _P], _R]:
    """Run an endpoint method under the endpoint's lock (every NIXL call of an agent from one thread at a time)."""

    @functools.wraps(fn)
    def wrapper(ep: _E, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with ep._lock:
            return fn(ep, *args, **kwargs)

    return wrapper


class EndpointBase:
    """The state an endpoint's parts share (set by ``Endpoint.__init__``)."""

    name: str
    mem_type: str
    _key: bytes | None
    _ctx: zmq.Context[zmq.Socket[bytes]]
    _stop: threading.Event
    _server: SideChannelServer | SideChannelProcess | None
    _controls: collections.deque[ControlMessage]
    _controls_overflowed: bool
    _courier: Courier | None
    _closed: bool
    _lock: threading.RLock
    _agent: Agent
    _peers: Peers
    _requests: InFlight
    _inbox: Inbox

    def _progress(self) -> None:
        """Progress everything once without taking the events (``Endpoint`` defines it)."""
        raise NotImplementedError

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"endpoint {self.name!r} is closed")
