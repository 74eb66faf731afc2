"""Transport tests need the NIXL wheel and pyzmq; they use real agents, processes and bytes."""

import _peers  # noqa: F401  (loads the transport even before the native binding is built)
import pytest

pytest.importorskip("nixl")
pytest.importorskip("zmq")
