"""The README's connector settings table is ``connector_core/config.py``'s ``SETTINGS``: every key with its
env var, in the table (the connector core imports no vLLM, so this runs in the main venv)."""

from __future__ import annotations

import re
from pathlib import Path

from hybrid_kv.connector_core.config import SETTINGS

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_is_in_the_readme_table() -> None:
    rows = dict(re.findall(r"^\| `(\w+)` \| `(HYBRID_KV_\w+)` \|", (ROOT / "README.md").read_text(), re.M))
    assert rows == {k: v[0] for k, v in SETTINGS.items()}
