"""Eviction policies, one small module each behind one interface (edgec/kvcache/policies/base.py)."""

from __future__ import annotations

from types import ModuleType

from edgec.kvcache.policies import adaptive, h2o, snapkv, streaming, tova

POLICIES: dict[str, ModuleType] = {module.name: module for module in (streaming, h2o, snapkv, adaptive, tova)}


def get(name: str) -> ModuleType:
    return POLICIES[name]
