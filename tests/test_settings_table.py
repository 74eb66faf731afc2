"""The README's connector settings table is ``connector_core/config.py``'s ``SETTINGS``: every key with its
env var, in the table (the config module imports no vLLM, so this runs in the main venv)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_is_in_the_readme_table() -> None:
    # config.py alone: the package's __init__ imports vLLM
    path = ROOT / "python/hybrid_kv/connector_core/config.py"
    spec = importlib.util.spec_from_file_location("hkv_vllm_config", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    rows = dict(re.findall(r"^\| `(\w+)` \| `(HYBRID_KV_\w+)` \|", (ROOT / "README.md").read_text(), re.M))
    assert rows == {k: v[0] for k, v in mod.SETTINGS.items()}
