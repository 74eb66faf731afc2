"""One kit step in its own process: ``python -m hybrid_kv.kit.step NAME CONFIG.json RESULT.json``.

The step writes its result file after every figure it adds (``Report``), so a step the kit stops at its time
bound still leaves what it measured. A step that raises records why (its traceback in the result) and exits 0:
the kit reads the verdict from the file, never from the exit status.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
import traceback
from typing import Any

from .config import STEPS, KitConfig

__all__ = ["Report", "main"]


class Report:
    """A step's result, saved to ``path`` (atomically) each time it changes.

    ``ok`` is false once a problem is recorded. ``figures`` holds what the step measured, ``problems`` one line
    per failed part (the step went on after each).
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.data: dict[str, Any] = {"ok": True, "figures": {}, "problems": [], "finished": False}
        self.save()

    def put(self, key: str, value: Any) -> None:
        self.data["figures"][key] = value
        self.save()

    def problem(self, text: str, detail: str = "") -> None:
        self.data["ok"] = False
        self.data["problems"].append(text)
        if detail:
            self.data.setdefault("details", []).append(detail[-4000:])
        self.save()

    def save(self) -> None:
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1, default=_jsonable)
        os.replace(tmp, self.path)


def _jsonable(obj: Any) -> Any:
    """numpy scalars and arrays as plain JSON values."""
    if hasattr(obj, "tolist"):
        return obj.tolist()
    return str(obj)


def main(argv: list[str]) -> int:
    name, config_path, result_path = argv
    if name not in STEPS:
        print(f"unknown kit step {name!r}; known: {', '.join(STEPS)}", file=sys.stderr)
        return 2
    with open(config_path) as f:
        cfg = KitConfig.from_json(f.read())
    report = Report(result_path)
    t0 = time.perf_counter()
    try:
        module = importlib.import_module(f"hybrid_kv.kit.steps.{name}")
        module.run(cfg, report)
    except BaseException as exc:  # noqa: BLE001 - the verdict goes into the result file
        report.problem(f"{type(exc).__name__}: {exc}", traceback.format_exc())
    report.data["finished"] = True
    report.data["step_s"] = time.perf_counter() - t0
    report.save()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
