"""Graph passes, one per file, each declaring ``PASS = Pass(...)`` (passes/_contract.py) beside its function.

Adding a pass is adding a file: every module here whose name does not start with ``_`` is registered.
``edgec.pipeline`` decides which passes a build runs and in which order; ``run_passes`` applies them.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import TYPE_CHECKING

import onnx_ir as ir

from edgec.errors import BuildSettingsError
from edgec.passes._contract import Pass

if TYPE_CHECKING:
    from edgec.kvcache.spec import CacheSpec


def _discover() -> dict[str, Pass]:
    found = {}
    for module_info in pkgutil.iter_modules(__path__):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{module_info.name}")
        declared = getattr(module, "PASS", None)
        if not isinstance(declared, Pass) or declared.name != module_info.name:
            raise RuntimeError(f"passes/{module_info.name}.py must declare PASS = Pass({module_info.name!r}, ...)")
        found[declared.name] = declared
    return dict(sorted(found.items()))


PASSES: dict[str, Pass] = _discover()


def run_passes(
    model: ir.Model, names: list[str], options: dict[str, dict] | None = None, spec: CacheSpec | None = None
) -> tuple[dict[str, int], CacheSpec | None]:
    """Apply the named passes in order, each with its ``options[name]`` keywords; returns the change count of
    each (recorded in the manifest) and the cache spec after them (passes with ``cache=True`` change it)."""
    unknown = [name for name in names if name not in PASSES]
    if unknown:
        raise BuildSettingsError(f"unknown pass(es) {', '.join(unknown)}; known: {', '.join(PASSES)}")
    options = options or {}
    counts = {}
    for name in names:
        step = PASSES[name]
        if step.cache:
            if spec is None:
                raise ValueError(f"pass {name} changes the cache state: give the spec of the graph")
            counts[name], spec = step.run(model, spec, **options.get(name, {}))
        else:
            counts[name] = step.run(model, **options.get(name, {}))
    return counts, spec
