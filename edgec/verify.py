"""``edgec verify``: can this bundle be trusted and run on this machine? One check per line.

Needs only what the runtime needs (numpy, onnxruntime, tokenizers); ``nvidia-ml-py`` is used when present to read
a GPU's compute capability, ``polygraphy`` when present to compare two runtimes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgec.bundle import FORMAT_VERSION, MANIFEST, sha256_file
from edgec.manifest_schema import manifest_errors

# fp32 graphs agree with the source model to ~1e-4 (see the build's validation); anything past this is damage
COMPARE_TOLERANCE = {"float32": 1e-3, "float16": 5e-2}
NOT_COMPUTE = "AzureExecutionProvider"


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "pass", "fail" or "skip"
    detail: str

    def line(self) -> str:
        return f"{self.status.upper():4}  {self.name}: {self.detail}"


def verify(bundle: str | Path, compare: bool = False) -> list[Check]:
    """Run every check; never raises for a problem with the bundle (that is a failed check)."""
    bundle = Path(bundle)
    checks: list[Check] = []
    manifest = _manifest_checks(bundle, checks)
    if manifest is None:
        return checks
    _file_checks(bundle, manifest, checks)
    _runtime_checks(manifest, checks)
    if compare:
        if any(check.status == "fail" for check in checks):
            checks.append(Check("compare", "skip", "earlier checks failed"))
        else:
            try:
                checks += compare_with_reference(bundle, manifest)
                checks.append(compare_runtimes(bundle, manifest))
            except Exception as error:  # the bundle could not even run: that is the finding
                checks.append(Check("compare", "fail", f"the bundle does not run: {type(error).__name__}: {error}"))
    return checks


def _manifest_checks(bundle: Path, checks: list[Check]) -> dict | None:
    path = bundle / MANIFEST
    if not bundle.is_dir() or not path.is_file():
        checks.append(Check("manifest", "fail", f"{path} not found: not an edgec bundle"))
        return None
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        checks.append(Check("manifest", "fail", f"not valid JSON ({error})"))
        return None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if not isinstance(version, int) or version > FORMAT_VERSION:
        checks.append(
            Check("format version", "fail", f"bundle format {version!r}; this edgec reads ≤ {FORMAT_VERSION}")
        )
        return None
    checks.append(Check("format version", "pass", f"{version}"))
    errors = manifest_errors(manifest)
    checks.append(Check("manifest schema", "fail" if errors else "pass", "; ".join(errors[:5]) or "valid"))
    return None if errors else manifest


def _file_checks(bundle: Path, manifest: dict, checks: list[Check]) -> None:
    listed = set(manifest["files"])
    present = {p.relative_to(bundle).as_posix() for p in bundle.rglob("*") if p.is_file()} - {MANIFEST}
    missing, extra = sorted(listed - present), sorted(present - listed)
    detail = "; ".join(
        filter(None, [missing and f"missing {', '.join(missing)}", extra and f"extra {', '.join(extra)}"])
    )
    checks.append(Check("file set", "fail" if detail else "pass", detail or f"{len(listed)} files, as listed"))
    for name in sorted(listed & present):
        entry, path = manifest["files"][name], bundle / name
        size = path.stat().st_size
        if size != entry["size"]:
            checks.append(Check(f"file {name}", "fail", f"{size} bytes, manifest says {entry['size']} (truncated?)"))
        elif sha256_file(path) != entry["sha256"]:
            checks.append(Check(f"file {name}", "fail", "sha256 differs from the manifest (damaged or tampered)"))
        else:
            checks.append(Check(f"file {name}", "pass", f"sha256 ok, {size:,} bytes"))


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def _runtime_checks(manifest: dict, checks: list[Check]) -> None:
    runtime = manifest["runtime"]
    if runtime["library"] == "tensorrt_rtx":
        checks.append(_tensorrt_rtx_check(runtime))
        checks.append(_gpu_check(manifest["target"]))
        return
    try:
        import onnxruntime
    except ImportError:
        checks.append(Check("runtime library", "fail", "onnxruntime is not installed: pip install 'edgec[runtime]'"))
        return
    ok = _version_tuple(onnxruntime.__version__) >= _version_tuple(runtime["min_version"])
    checks.append(
        Check(
            "runtime library",
            "pass" if ok else "fail",
            f"onnxruntime {onnxruntime.__version__} (bundle needs ≥ {runtime['min_version']})",
        )
    )
    from edgec.runtime.model import install_hint

    available = onnxruntime.get_available_providers()
    missing = [p for p in runtime["providers"] if p not in available]
    checks.append(
        Check(
            "execution provider",
            "fail" if missing else "pass",
            f"missing {', '.join(missing)}: {install_hint(runtime)}" if missing else ", ".join(runtime["providers"]),
        )
    )
    checks.append(_gpu_check(manifest["target"]))


def _tensorrt_rtx_check(runtime: dict) -> Check:
    try:
        import tensorrt_rtx
    except ImportError:
        return Check("runtime library", "fail", "tensorrt_rtx is not installed: pip install 'edgec[tensorrt-rtx]'")
    # an engine loads only in the TensorRT-RTX release that built it (the bundle's ONNX can rebuild it)
    same = tensorrt_rtx.__version__ == runtime["version"]
    return Check(
        "runtime library",
        "pass" if same else "fail",
        f"tensorrt_rtx {tensorrt_rtx.__version__}, engine built with {runtime['version']}",
    )


def _gpu_check(target: dict) -> Check:
    wanted = target.get("compute_capability")
    if target["device"] != "gpu" or not wanted:
        return Check("gpu", "skip", f"not needed ({target['device']} target)")
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        have = "{}.{}".format(*pynvml.nvmlDeviceGetCudaComputeCapability(handle))
    except ImportError:
        return Check(
            "gpu",
            "fail",
            f"needs an NVIDIA GPU of compute capability {wanted}; to check for one here: pip install nvidia-ml-py",
        )
    except Exception as error:  # no driver or no GPU: it cannot run here
        return Check("gpu", "fail", f"needs an NVIDIA GPU of compute capability {wanted}; none found ({error})")
    return Check("gpu", "pass" if have == str(wanted) else "fail", f"this GPU is sm {have}, bundle built for {wanted}")


def compare_with_reference(bundle: Path, manifest: dict) -> list[Check]:
    """Run the bundle on the build's validation prompts; compare with the source model's stored logits."""
    from edgec.runtime import Model

    model = Model.load(bundle)
    tolerance = COMPARE_TOLERANCE.get(manifest["cache"]["dtype"], 1e-3)
    stored = np.load(bundle / "validation.npz")
    checks = []
    for index in range(manifest["validation"]["prompts"]):
        ids, want = stored[f"ids_{index}"], stored[f"logits_{index}"]
        got = model.next_token_logits(ids.tolist())
        error = float(np.abs(got - want).max())
        same_top1 = int(got.argmax()) == int(want.argmax())
        ok = error <= tolerance and same_top1
        checks.append(
            Check(
                f"reference logits, prompt {index}",
                "pass" if ok else "fail",
                f"max |Δ| {error:.2e} (tolerance {tolerance:g}), top-1 {'same' if same_top1 else 'DIFFERS'}",
            )
        )
    return checks


def compare_runtimes(bundle: Path, manifest: dict, providers: list[str] | None = None) -> Check:
    """Where a second ONNX Runtime provider is present, compare it with the CPU provider through polygraphy."""
    import onnxruntime

    if providers is None:
        # Azure's provider calls a remote endpoint: not a second local runtime
        available = onnxruntime.get_available_providers()
        providers = ["CPUExecutionProvider"] + [p for p in available if p not in ("CPUExecutionProvider", NOT_COMPUTE)]
    if len(providers) < 2:
        return Check("cross-runtime", "skip", "only ONNX Runtime's CPU provider is present on this machine")
    first, second = providers[:2]
    try:
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
        from polygraphy.comparator import Comparator, CompareFunc
    except ImportError:
        return Check("cross-runtime", "skip", f"{second} present, but polygraphy is not: pip install polygraphy")
    model_path = str(bundle / manifest["model"]["file"])
    runners = [
        OnnxrtRunner(SessionFromOnnx(model_path, providers=[provider]), name=f"{index}:{provider}")
        for index, provider in enumerate((first, second))
    ]
    results = Comparator.run(runners, data_loader=_validation_feeds(bundle, manifest))
    ok = bool(Comparator.compare_accuracy(results, compare_func=CompareFunc.simple(atol=1e-2, rtol=1e-2)))
    return Check("cross-runtime", "pass" if ok else "fail", f"{first} vs {second} (polygraphy)")


def _validation_feeds(bundle: Path, manifest: dict) -> list[dict]:
    import onnx

    from edgec.kvcache.spec import CacheSpec

    spec = CacheSpec.from_json(manifest["cache"])
    if manifest["format_version"] < 2:  # v1 named the state only in part: what the graph has
        graph = onnx.load(str(bundle / manifest["model"]["file"]), load_external_data=False).graph
        spec = spec.keeping({value.name for value in graph.input})
    stored = np.load(bundle / "validation.npz")
    feeds = []
    for index in range(manifest["validation"]["prompts"]):
        ids = stored[f"ids_{index}"].astype(np.int64)
        feed = {
            "input_ids": ids[None],
            "position_ids": np.arange(len(ids))[None],
            "logits_index": np.array([len(ids) - 1]),
        }
        feeds.append(feed | spec.empty_feeds(len(ids)))
    return feeds
