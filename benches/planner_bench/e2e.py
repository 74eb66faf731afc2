"""4. End to end: one request READ through NIXL between two agents (real DRAM pools), planned by hybrid-kv
versus the same ids handed to NIXL by hand; descriptors posted with and without NIXL's merging.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np

import hybrid_kv as hk
from hybrid_kv.presets import get_preset

from .common import KIB, local_tables, nixl_agent, peer_plan_binding
from .timing import fmt_t, print_table, side_by_side


class E2E:
    """A TP1 -> TP1 pull of ``preset``: prefill agent "P" (target) and decode agent "D" (initiator), in one
    process with progress threads off (D polls, and pumps P, as the transport does); the presets' pools are on
    huge pages."""

    def __init__(self, preset_name: str, num_blocks: int, kernel_block_size: int | None = None) -> None:
        import torch

        preset = get_preset(preset_name)
        self.preset = preset
        self.num_blocks = num_blocks
        self.pools: dict[str, list[Any]] = {}
        self.tables: dict[str, Any] = {}
        self.agents: dict[str, Any] = {}
        self.regs: dict[str, Any] = {}
        gen = torch.Generator().manual_seed(1)
        for side in ("P", "D"):
            pools, layers, geo = preset.torch_layers(1, 0, num_blocks, kernel_block_size=kernel_block_size)
            if side == "P":
                for t in pools:
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=gen))
            self.geo = geo
            self.pools[side] = pools
            self.tables[side] = hk.build_region_table(preset.layout_from_tensors(layers, geo, 0, num_blocks))
            agent = nixl_agent(side, telemetry=side == "D")
            self.regs[side] = agent.register_memory(self.tables[side].registration(), "DRAM")
            self.agents[side] = agent
        self.d, self.p = self.agents["D"], self.agents["P"]
        self.d.add_remote_agent(self.p.get_agent_metadata())
        payload = self.tables["P"].handshake_payload(preset.engine_info("prefill", "pull"))
        # Both modes, each transferring through handles prepped from its own plan's tables (chunk ids index the
        # coalesced tables' appended rows).
        self.peers: dict[str, Any] = {}
        self.lh: dict[str, dict[str, Any]] = {}
        self.rh: dict[str, dict[int, Any]] = {}
        for mode, co in (("coalesced", True), ("reference", False)):
            peer = peer_plan_binding()(self.tables["D"], [payload], "pull", coalesce=co)
            self.peers[mode] = peer
            prep = self.d.prep_xfer_dlist
            self.lh[mode] = {k: prep("NIXL_INIT_AGENT", rows, "DRAM") for k, rows in local_tables(peer)}
            self.rh[mode] = {0: self.d.prep_xfer_dlist("P", peer.remote_rows(0), "DRAM")}
        self.kinds = [k != "ssm" for k in preset.group_kinds()]

    def ids(self, tokens: int, fragmented: bool, seed: int) -> tuple[list[list[int]], list[list[int]]]:
        """Logical block ids per group for a ``tokens``-token request on each side, contiguous or fragmented."""
        rng = np.random.default_rng(seed)
        n = -(-tokens // self.geo.logical_block_size)

        def side(off: int) -> list[list[int]]:
            pick = rng.permutation(self.num_blocks)
            att = pick[:n].tolist() if fragmented else list(range(off, off + n))
            # SSM states in blocks the attention run does not use (a request's blocks are distinct).
            free = [b for b in pick.tolist() if b not in set(att)]
            return [att if k else [free[g]] for g, k in enumerate(self.kinds)]

        return side(1), side(2)

    def post(self, transfers: list[tuple[int, str, Any, Any]], mode: str, skip_merge: bool = False) -> int:
        """Post every transfer through ``mode``'s handles, wait for all, release; returns the descriptors NIXL
        posted (after merging)."""
        handles = []
        lh, rh = self.lh[mode], self.rh[mode]
        for rank, key, li, ri in transfers:
            h = self.d.make_prepped_xfer("READ", lh[key], li, rh[rank], ri, skip_desc_merge=skip_merge)
            state = self.d.transfer(h)
            handles.append((h, state))
        descs = 0
        for h, state in handles:
            while state != "DONE":
                if state == "ERR":
                    raise RuntimeError("NIXL transfer failed")
                self.p.get_new_notifs()
                state = self.d.check_xfer_state(h)
            descs += int(self.d.get_xfer_telemetry(h).descCount)
            self.d.release_xfer_handle(h)
        return descs

    def plan(self, lids: list[list[int]], rids: list[list[int]], mode: str) -> list[tuple[int, str, Any, Any]]:
        """``(remote rank, local table key, local ids, remote ids)`` of every transfer of ``mode``'s plan."""
        p = self.peers[mode].plan(lids, rids)
        return [(int(t.remote_rank), str(t.local_table), t.local_ids, t.remote_ids) for t in p.transfers]

    def clear(self) -> None:
        """Zero the decode pools, so that ``verify`` after a transfer checks that transfer alone."""
        for t in self.pools["D"]:
            t.zero_()

    def verify(self, lids: list[list[int]], rids: list[list[int]], tokens: int) -> None:
        """The attention pages and SSM states of the request arrived intact (pools hold random bytes)."""
        geo = self.geo
        n_kernel = -(-tokens // geo.kernel_block_size)
        for g, attn in enumerate(self.kinds):
            for lb, rb in zip(lids[g], rids[g], strict=True):
                for t in range(len(self.pools["D"])):
                    dst = self.pools["D"][t][lb].numpy()
                    src = self.pools["P"][t][rb].numpy()
                    if attn:
                        k = min(geo.ppl, n_kernel) * geo.kernel_page_bytes
                        assert np.array_equal(dst[:k], src[:k]), f"attention block {lb} of tensor {t} differs"
                    else:
                        k = geo.state_bytes
                        assert np.array_equal(dst[:k], src[:k]), f"SSM state {lb} of tensor {t} differs"
            if attn:
                n_kernel -= geo.ppl * len(lids[g])

    def bytes_of(self, transfers: list[tuple[int, str, Any, Any]], mode: str) -> int:
        """Bytes the transfers move, summed over the lengths of the local rows their ids name."""
        tabs = dict(local_tables(self.peers[mode]))
        total = 0
        for _, key, li, _ in transfers:
            rows = tabs[key]
            lens = np.repeat(rows[:, 1], rows[:, 4].astype(np.int64))
            total += int(lens[np.asarray(li, dtype=np.int64)].sum())
        return total

    def close(self) -> None:
        """Release every prepped handle and registration of both agents."""
        for side, agent in self.agents.items():
            if side == "D":
                for mode in self.peers:
                    for h in [*self.lh[mode].values(), *self.rh[mode].values()]:
                        agent.release_dlist_handle(h)
            agent.deregister_memory(self.regs[side])
        self.agents.clear()


def e2e_case(
    args: argparse.Namespace,
    e: E2E,
    model: str,
    lengths: list[int],
    out: dict[str, Any],
    rows_over: list[list[str]],
    rows_merge: list[list[str]],
) -> None:
    """Transfer, verify and time every request length of one model, both modes; appends to both tables."""
    modes = ("coalesced", "reference")
    for tokens in lengths:
        for frag in (False, True):
            lids, rids = e.ids(tokens, frag, seed=tokens)
            planned = {m: e.plan(lids, rids, m) for m in modes}
            for m in modes:
                e.clear()
                e.post(planned[m], m)
                e.verify(lids, rids, tokens)
            nbytes = e.bytes_of(planned["reference"], "reference")
            assert e.bytes_of(planned["coalesced"], "coalesced") == nbytes, "coalesced plan moves other bytes"
            ids = {m: sum(len(li) for _, _, li, _ in planned[m]) for m in modes}
            # The same number of bytes copied by one memcpy between touched buffers: the bar for the transfer.
            src_buf, dst_buf = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
            dst_buf.fill(1)
            impls: dict[str, Callable[[], Any]] = {
                "memcpy": lambda s=src_buf, d=dst_buf: np.copyto(d, s),
                "plan only": lambda lids=lids, rids=rids: e.plan(lids, rids, "coalesced"),
                "plan only reference": lambda lids=lids, rids=rids: e.plan(lids, rids, "reference"),
                "by hand": lambda p=planned["coalesced"]: e.post(p, "coalesced"),
                "by hand reference": lambda p=planned["reference"]: e.post(p, "reference"),
                "hybrid-kv": lambda lids=lids, rids=rids: e.post(e.plan(lids, rids, "coalesced"), "coalesced"),
            }
            if not frag:
                impls["no merge"] = lambda p=planned["coalesced"]: e.post(p, "coalesced", skip_merge=True)
                impls["no merge reference"] = lambda p=planned["reference"]: e.post(p, "reference", skip_merge=True)
            t = side_by_side(impls, args.repeats, inner={"plan only": 20, "plan only reference": 20})
            med = {k: t.median(k) for k in t.samples}
            posted = {m: e.post(planned[m], m) for m in modes}
            posted_nomerge = {m: e.post(planned[m], m, skip_merge=True) for m in modes}
            label = f"{model} {tokens // KIB}K {'fragmented' if frag else 'contiguous'}"
            out[label] = {
                "tokens": tokens,
                "fragmented": frag,
                "bytes": nbytes,
                "ids": ids["reference"],
                "ids_coalesced": ids["coalesced"],
                "descs_posted": posted["reference"],
                "descs_posted_nomerge": posted_nomerge["reference"],
                "descs_posted_coalesced": posted["coalesced"],
                "descs_posted_coalesced_nomerge": posted_nomerge["coalesced"],
                "median_s": med,
                "samples_s": t.samples,
            }
            over = med["plan only"] / med["by hand"]
            rows_over.append(
                [
                    label,
                    f"{nbytes / 2**20:,.0f} MiB",
                    f"{ids['reference']:,}",
                    f"{ids['coalesced']:,}",
                    fmt_t(med["plan only reference"]),
                    fmt_t(med["plan only"]),
                    fmt_t(med["by hand"]),
                    fmt_t(med["hybrid-kv"]),
                    f"{100 * over:.3f}%",
                    f"{100 * (med['hybrid-kv'] - med['by hand']) / med['by hand']:+.1f}%",
                ]
            )

            def gbs(k: str, nbytes: int = nbytes, med: dict[str, float] = med) -> str:
                return f"{nbytes / med[k] / 1e9:.2f}" if k in med else "-"

            rows_merge.append(
                [
                    label,
                    f"{ids['reference']:,}",
                    f"{posted['reference']:,}",
                    f"{posted_nomerge['reference']:,}",
                    f"{ids['coalesced']:,}",
                    f"{posted['coalesced']:,}",
                    f"{posted_nomerge['coalesced']:,}",
                    gbs("by hand reference"),
                    gbs("by hand"),
                    gbs("no merge reference"),
                    gbs("no merge"),
                    gbs("memcpy"),
                    f"{med['memcpy'] / med['by hand']:.2f}",
                    f"{med['memcpy'] / med['hybrid-kv']:.2f}",
                ]
            )


def bench_e2e(args: argparse.Namespace, results: dict[str, Any]) -> None:
    """Section 4: real NIXL READs of Kimi-Linear and DeepSeek-V3 requests, planned by hybrid-kv and by hand."""
    if peer_plan_binding() is None:
        print("\n### End-to-end transfer: skipped (hybrid_kv has no PeerPlan binding yet)")
        return
    cases: list[tuple[str, str, int | None, list[int]]] = [
        ("Kimi-Linear", "kimi-linear-48b-a3b", None, [4 * KIB, 32 * KIB] + ([128 * KIB] if args.full else [])),
        # Descriptor-bound: DeepSeek-V3 with 16-token kernel blocks (18 KiB pages, one block per descriptor).
        ("DeepSeek-V3 (block 16)", "deepseek-v3", 16, [4 * KIB] + ([32 * KIB] if args.full else [])),
    ]
    out = results.setdefault("e2e", {})
    rows_over: list[list[str]] = []
    rows_merge: list[list[str]] = []
    for model, preset_name, kb, lengths in cases:
        logical = get_preset(preset_name).geometry(1, kernel_block_size=kb).logical_block_size
        e = E2E(preset_name, 2 * -(-max(lengths) // logical) + 4, kb)
        try:
            e2e_case(args, e, model, lengths, out, rows_over, rows_merge)
        finally:
            e.close()
    print_table(
        "Planning overhead on a real NIXL READ (TP1 -> TP1 pull, DRAM, two agents in one process; median)",
        [
            "request",
            "bytes",
            "id pairs reference",
            "id pairs coalesced",
            "plan() reference",
            "plan() coalesced",
            "by hand, coalesced (post+wait)",
            "hybrid-kv, coalesced (plan+post+wait)",
            "plan / transfer (coalesced)",
            "difference",
        ],
        rows_over,
    )
    print_table(
        "Descriptors posted (NIXL telemetry descCount) and throughput, reference and coalesced ids, with and "
        "without NIXL's merging (unmerged throughput: contiguous only)",
        [
            "request",
            "ref ids",
            "ref posted (merged)",
            "ref posted (skip_desc_merge)",
            "coalesced ids",
            "coalesced posted (merged)",
            "coalesced posted (skip_desc_merge)",
            "GB/s ref merged",
            "GB/s coalesced merged",
            "GB/s ref unmerged",
            "GB/s coalesced unmerged",
            "GB/s memcpy",
            "by hand / memcpy",
            "hybrid-kv / memcpy",
        ],
        rows_merge,
    )
