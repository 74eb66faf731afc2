"""hybrid-kv's connector with one injected fault, for the real-engine streaming test (never used elsewhere).

``FaultyHybridKvConnector`` behaves exactly as ``HybridKvConnector`` except that NIXL fails (``ERR``) the
first transfer a prefill worker posts for a request whose (decode) request id contains ``FAIL_MARK``: with
streaming, that is the request's first stage, posted at an early layer hook while later layers still run.
The engine loads it by ``kv_connector_module_path`` (``tests/engines`` on its ``PYTHONPATH``).
"""

from __future__ import annotations

from typing import Any

from hybrid_kv.integrations.vllm import HybridKvConnector
from hybrid_kv.transport import notifications

FAIL_MARK = "fail-early"


class FaultyHybridKvConnector(HybridKvConnector):  # type: ignore[misc]
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        assert self.worker is not None and self.worker.server is not None
        nixl = self.worker.server._agent.nixl
        real_make, real_transfer = nixl.make_prepped_xfer, nixl.transfer
        doomed: set[int] = set()
        failed: set[str] = set()

        def make(*args: Any, **kwargs: Any) -> Any:
            handle = real_make(*args, **kwargs)
            notice = notifications.parse(kwargs.get("notif_msg", b""))
            if notice is not None and FAIL_MARK in notice.request_id and notice.request_id not in failed:
                failed.add(notice.request_id)
                doomed.add(id(handle))
            return handle

        def transfer(handle: Any, *args: Any, **kwargs: Any) -> Any:
            if id(handle) in doomed:
                doomed.discard(id(handle))
                return "ERR"
            return real_transfer(handle, *args, **kwargs)

        nixl.make_prepped_xfer, nixl.transfer = make, transfer
