"""Reading UCX's protocol-selection tables (``UCX_PROTO_INFO=y``) for the transports NIXL used
(``hybrid_kv.kit.ucx``): the lines as UCX prints them, with its timestamp and host prefix."""

from __future__ import annotations

from hybrid_kv.kit.ucx import summarize, tables

PREFIX = "[1796405768.998720] [vm:7327 :0]   "
LOG = [
    PREFIX + line
    for line in """+--------+-------------+-----------------------------------+
| decode-0 intra-node cfg#1                                |
| remote memory read by ucp_get*(multi) into cuda memory from cuda |
+--------+-------------+-----------------------------------+
| Range  | Description |              Config               |
+--------+-------------+-----------------------------------+
|  0..8k | zero-copy   | cuda_ipc/cuda                     |
| 8k..inf| zero-copy   | 50% on cuda_ipc/cuda and 50% on cuda_copy/cuda |
+--------+-------------+-----------------------------------+
+------------+--------------------+---------------+
| decode-0 intra-node cfg#1                       |
| active message by ucp_am_send* from host memory |
+------------+--------------------+---------------+
|   Range    |    Description     |    Config     |
+------------+--------------------+---------------+
|          0 | short              | tcp/lo        |
+------------+--------------------+---------------+
+--------+-------------+-----------------------------------+
| decode-0 self cfg#0                                      |
| remote memory write by ucp_put* from host memory to host |
+--------+-------------+-----------------------------------+
| Range  | Description |              Config               |
+--------+-------------+-----------------------------------+
| 0..inf | zero-copy   | cma/memory                        |
+--------+-------------+-----------------------------------+
+--------+-------------+-----------------------------------+
| decode-0 intra-node cfg#2                                |
| remote memory write by ucp_put* from host memory to host |
+--------+-------------+-----------------------------------+
| Range  | Description |              Config               |
+--------+-------------+-----------------------------------+
| 0..inf | zero-copy   | cma/memory                        |
+--------+-------------+-----------------------------------+""".splitlines()
] + ["hybrid-kv: an unrelated line | with a bar |"]


def test_tables_read_worker_peer_operation_and_transports() -> None:
    found = tables(LOG)
    assert [(t["worker"], t["peer"]) for t in found] == [("decode-0", "intra-node")] * 2 + [
        ("decode-0", "self"),
        ("decode-0", "intra-node"),
    ]
    assert found[0]["operation"] == "remote memory read by ucp_get*(multi) into cuda memory from cuda"
    assert found[0]["transports"] == ["cuda_ipc/cuda", "cuda_copy/cuda"]
    assert found[1]["transports"] == ["tcp/lo"]


def test_summary_keeps_rma_to_other_processes_by_memory_type() -> None:
    s = summarize(tables(LOG))
    assert s["rma_kinds"] == {"cuda": ["cuda_copy", "cuda_ipc"], "host": ["cma"]}  # the self table left out
    assert list(s["other"]) == ["active message by ucp_am_send* from host memory"]
    assert summarize([]) == {"rma": {}, "other": {}, "rma_kinds": {}}
