"""``hybrid-kv regions``: build the region table of a tiny Kimi-Linear-like layout from torch CPU tensors."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.table import Table

from ..fixtures import F2_PAGE, f2_geometry, f2_sharers
from ..layout import Spec
from ._args import positive_int
from ._console import console as make_console

__all__ = ["MAX_REGIONS", "register", "run", "tiny_kimi_layers"]

MAX_REGIONS = 4096
"""Most shared tensors (one small torch tensor and one table region each)."""


def tiny_kimi_layers(num_regions: int) -> tuple[list[tuple[str, int, Spec, Any]], dict[str, int]]:
    """Tensors of a tiny Kimi-Linear-shaped HMA pool: each tensor shared by one MLA and two KDA layers.

    Shapes follow ``hybrid_kv.fixtures``: MLA latents of 6 fp16 per token, KDA conv ``(8, 3)`` fp16 and
    temporal ``(1, 4, 4)`` fp32 padded to the 144-byte unified page; logical block 12, kernel block 4.
    """
    import torch

    geometry = f2_geometry()
    layers: list[tuple[str, int, Spec, Any]] = []
    for i in range(num_regions):
        pool = torch.zeros(geometry["num_logical_blocks"] * F2_PAGE, dtype=torch.uint8)
        layers += [(f"{name}.{i}", group, spec, pool) for name, group, spec in f2_sharers()]
    return layers, geometry


def run(args: argparse.Namespace) -> int:
    """Build and print the table."""
    from . import require

    require("torch")
    from ..torch_adapter import region_table_from_tensors

    layers, geometry = tiny_kimi_layers(args.regions)
    table = region_table_from_tensors(
        layers,
        logical_block_size=geometry["logical_block_size"],
        kernel_block_size=geometry["kernel_block_size"],
        num_logical_blocks=geometry["num_logical_blocks"],
    )
    info = json.loads(table.to_json())
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    console = make_console()
    t = Table(title=f"Region table: {table!r}")
    for col in ("#", "name", "base", "bytes", "block_len", "stride", "kernel blocks", "MLA", "SSM", "group"):
        t.add_column(col, justify="right" if col not in ("name", "MLA", "SSM") else "left")
    for i, r in enumerate(info["regions"]):
        group = "shared" if r["group"] is None else str(r["group"])
        t.add_row(
            str(i),
            r["name"],
            hex(r["base"]),
            str(r["bytes"]),
            str(r["block_len"]),
            str(r["block_stride"]),
            str(r["num_blocks"]),
            "yes" if r["is_mla"] else "no",
            "yes" if r["has_ssm"] else "no",
            group,
        )
    console.print(t)
    descs = table.local_descs()
    rows = table.local_rows()
    console.print(
        f"local descriptor table: {descs.shape[0]} descriptors ({table.num_fa_descs()} attention + "
        f"{descs.shape[0] - table.num_fa_descs()} SSM) in {rows.shape[0]} strided rows; "
        f"ppl={table.ppl}, ssm_sizes={table.ssm_sizes}"
    )
    return 0


def register(sub: Any) -> None:
    """Add the ``regions`` subcommand."""
    p = sub.add_parser(
        "regions",
        help="region table of a tiny Kimi-Linear-like layout built from torch CPU tensors",
        description="Allocate a tiny Kimi-Linear-shaped HMA pool (MLA + KDA layers sharing tensors) as torch "
        "CPU tensors, build its region table in Rust and print it.",
    )
    p.add_argument(
        "--regions",
        type=positive_int(MAX_REGIONS),
        default=2,
        metavar="N",
        help=f"number of shared tensors, 1-{MAX_REGIONS} (default 2)",
    )
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.set_defaults(func=run)
