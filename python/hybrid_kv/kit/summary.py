"""The kit's summary as lines a person reads (the JSON has every figure; these are the headline ones)."""

from __future__ import annotations

from typing import Any

__all__ = ["lines"]


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _t(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.2f} s" if s >= 1 else f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.0f} us"


def lines(summary: dict[str, Any]) -> list[str]:
    """One line per measured item, grouped by step, failures first in each step."""
    steps = summary.get("steps", {})
    bad = [k for k, v in steps.items() if not v.get("ok")]
    dev = steps.get("environment", {}).get("figures", {}).get("device", {})
    where = summary.get("device", "?") + (f" ({dev['gpu']}, {dev['memory_total_gib']:.0f} GiB)" if "gpu" in dev else "")
    verdict = "every step ok" if not bad else f"FAILED: {', '.join(bad)}"
    out = [f"hybrid-kv gpu-kit on {where}: {len(steps)} steps in {summary.get('total_s', 0):.0f} s, {verdict}"]
    for name, step in steps.items():
        figs = step.get("figures", {})
        out.append(f"{name}: {'ok' if step.get('ok') else 'FAILED'} in {step.get('seconds', 0):.1f} s")
        out += [f"  problem: {p}" for p in step.get("problems", [])[:8]]
        out += [f"  {line}" for line in _step_lines(name, figs)]
    return out


def _step_lines(name: str, figs: dict[str, Any]) -> list[str]:
    out: list[str] = []
    if name == "environment":
        t = figs.get("torch", {})
        out.append(
            f"python {figs.get('python')}, torch {t.get('version')} (CUDA {t.get('cuda')}), UCX {figs.get('ucx')}, "
            f"nixl {figs.get('packages', {}).get('nixl')}, side channel {figs.get('side_channel')}"
        )
    elif name == "registration":
        for k, v in figs.items():
            if isinstance(v, dict):
                out.append(
                    f"{k}: {_gb(v['bytes'])} {v['mem_type']} in {v['regions']} regions: "
                    f"register {_t(v['register_s'])}, prep {v['descriptors']} descriptors {_t(v['prep_s'])}, "
                    f"backend {_t(v['backend_s'])}, "
                    f"endpoint open {_t(v['endpoint_open_s'])}"
                )
    elif name == "transfer":
        for k, v in figs.items():
            if not isinstance(v, dict) or "batch_gbps" not in v:
                continue
            kinds = "; ".join(f"{m}: {','.join(ks)}" for m, ks in v["transports"]["rma_kinds"].items())
            out.append(
                f"{k}: {_gb(v['bytes'])} in {_t(v['batch_s'])} = {v['batch_gbps']:.2f} GB/s (copy {v['copy_gbps']:.2f}"
                f" GB/s, {v['batch_vs_copy']:.2f}x); one request {v['single_gbps']:.2f} GB/s; "
                f"{v['descriptors_per_s']:,.0f} desc/s; verify=all {v['verify_added_ratio']:+.0%} "
                f"({v['digest_algorithm']}); UCX {kinds}; {v['bytes_mismatched']} of {_gb(v['checked_bytes'])} differ"
            )
    elif name == "streaming":
        for k, v in figs.items():
            if isinstance(v, dict) and "tail_whole_s" in v:
                hidden = v["hidden_fraction"]
                out.append(
                    f"{k}: {_gb(v['bytes'])} in {v['stages']} stages, forward {_t(v['forward_s'])}, tail whole "
                    f"{_t(v['tail_whole_s'])} / streamed {_t(v['tail_layer_s'])}: "
                    f"{'-' if hidden is None else f'{hidden:.0%}'} hidden"
                )
    elif name == "planner":
        for k, v in figs.items():
            if isinstance(v, dict) and "requests" in v:
                per = ", ".join(f"{t} tok {r['plan_us']:.1f} us" for t, r in v["requests"].items() if "plan_us" in r)
                par = v.get("parallel") or {}
                extra = f"; x{par['threads']} threads {par['speedup']:.1f}x" if par else ""
                out.append(f"{k}: peer plan {_t(v['peer_plan_s'])}, plan {per}{extra}")
    return out
