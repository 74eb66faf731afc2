"""Import a package from a directory of its own (another build, an older version) without adding the directory to
``sys.path``, so nothing else imported later can come from it by accident."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from types import ModuleType

__all__ = ["import_package"]


def import_package(directory: str, name: str) -> ModuleType:
    """The package ``name`` found in ``directory`` (registered as ``name``; its submodules then import as usual)."""
    spec = importlib.machinery.PathFinder.find_spec(name, [directory])
    if spec is None or spec.loader is None:
        raise ImportError(f"no package {name!r} in {directory}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
