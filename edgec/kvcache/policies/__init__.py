"""Eviction policies, one small module each behind one interface (edgec/kvcache/policies/base.py).

Adding a policy is adding a file here: every module but ``base`` is registered under the ``name`` it declares.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


def _discover() -> dict[str, ModuleType]:
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda info: info.name):
        if info.name == "base" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        found[module.name] = module
    return found


POLICIES: dict[str, ModuleType] = _discover()


def get(name: str) -> ModuleType:
    return POLICIES[name]
