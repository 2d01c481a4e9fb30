"""The module rules of docs/architecture.md, checked: the runtime loads without the build side, passes import no
other pass, the cache contract (edgec.kvcache) depends on nothing else, and state names are made in one place."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUILD_SIDE = (
    "torch",
    "transformers",
    "onnx",
    "onnx_ir",
    "onnxscript",
    "click",
    "rich",
    "jinja2",
    "edgec.build",
    "edgec.passes",
    "edgec.pipeline",
    "edgec.targets",
    "edgec.export",
    "edgec.load",
    "edgec.plan",
    "edgec.blockquant",
)


def test_the_runtime_loads_and_generates_without_the_build_side(tiny_bundle):
    code = (
        "import sys\n"
        "from edgec.runtime import Model\n"
        f"m = Model.load({str(tiny_bundle)!r})\n"
        "m.generate('def f(x):', max_new_tokens=5)\n"
        f"print(' '.join(name for name in {BUILD_SIDE!r} if name in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"the runtime imported {done.stdout.strip()}"


def _edgec_imports(path: Path) -> set[str]:
    """Every edgec module a file imports (at any depth of the file, lazy imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("edgec"):
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("edgec")}
    return found


@pytest.mark.parametrize("path", sorted((ROOT / "passes").glob("[!_]*.py")), ids=lambda p: p.stem)
def test_a_pass_imports_no_other_pass_and_not_the_build(path):
    passes = {p.stem for p in (ROOT / "passes").glob("[!_]*.py")}
    for module in _edgec_imports(path):
        parts = module.split(".")
        assert not (parts[:2] == ["edgec", "passes"] and len(parts) > 2 and parts[2] in passes), module
        assert parts[:2] not in (["edgec", "build"], ["edgec", "pipeline"], ["edgec", "cli"]), module


@pytest.mark.parametrize("path", sorted((ROOT / "edgec" / "kvcache").rglob("*.py")), ids=lambda p: p.stem)
def test_the_cache_contract_depends_on_nothing_else_of_edgec(path):
    for module in _edgec_imports(path):
        assert module.startswith(("edgec.kvcache", "edgec.errors")), f"{path.name} imports {module}"


def test_state_names_are_made_only_by_the_cache_spec():
    """`cache.{i}.{name}` / `new_cache.…` are spelled in edgec/kvcache/spec.py alone; everyone else asks it."""
    pattern = re.compile(r"""["']\s*(new_)?cache\.(\{|\d|['"])|f["'](new_)?cache\.\{""")
    offenders = []
    for path in [*ROOT.glob("edgec/**/*.py"), *ROOT.glob("passes/*.py")]:
        if path.name == "spec.py" and path.parent.name == "kvcache":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
