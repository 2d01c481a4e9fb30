"""``edgec verify``: can this bundle be trusted and run on this machine? One check per line.

Needs only what the runtime needs (numpy, onnxruntime, tokenizers); ``nvidia-ml-py`` is used when present to read
a GPU's compute capability, ``polygraphy`` when present to compare two runtimes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgec.bundle import FORMAT_VERSION, MANIFEST, listed_file, read_json, sha256_file, unlisted_entries
from edgec.errors import BundleError, EdgecError, one_line
from edgec.manifest_schema import manifest_errors

# bundles from before the build recorded its own logits and tolerance are compared with the source model's logits:
# fp32 graphs agree with them to ~1e-4 (see the build's validation); anything past this is damage
COMPARE_TOLERANCE = {"float32": 1e-3, "float16": 5e-2}
NOT_COMPUTE = "AzureExecutionProvider"
REFERENCE = "validation.npz"  # the build's reference prompts and the source model's logits


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # "pass", "fail", "skip" or "info" (a recorded fact, not a check)
    detail: str

    def line(self) -> str:
        """One line for a terminal (names and details from a bundle may hold anything: escaped)."""
        return f"{self.status.upper():4}  {one_line(self.name)}: {one_line(self.detail)}"


def verify(bundle: str | Path, compare: bool = False, trust: Any = None) -> list[Check]:
    """Run every check; never raises for a problem with the bundle (that is a failed check). ``trust``: public
    key file(s); the bundle must then be signed by one of them (a bad key file raises ``KeyFileError``)."""
    bundle = Path(bundle)
    checks: list[Check] = []
    if trust is not None:
        from edgec.signing import load_public_keys

        trust = load_public_keys(trust)  # a bad key file is the caller's error, not the bundle's
    manifest = _manifest_checks(bundle, checks)
    if manifest is None:
        return checks
    signed = _signature_check(bundle, manifest, trust, checks)
    _file_checks(bundle, manifest, checks, signed)
    _graph_check(bundle, manifest, checks)
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
    if not bundle.is_dir() or not (path.is_file() or path.is_symlink()):
        checks.append(Check("manifest", "fail", f"{path} not found: not an edgec bundle"))
        return None
    try:
        manifest = read_json(path)
    except BundleError as error:
        checks.append(Check("manifest", "fail", str(error).replace(f"{path} is ", "")))
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


def _signature_check(bundle: Path, manifest: dict, trust: list | None, checks: list[Check]) -> bool:
    """Whether the bundle is signed by a trusted key; without ``trust`` only says who it claims to be signed by."""
    from edgec.signing import bundle_signer

    signer = bundle_signer(bundle)
    if trust is None:
        detail = f"signed by key {signer}, not checked (pass --trust PUBKEY)" if signer else "unsigned"
        checks.append(Check("signature", "skip", detail))
        return False
    from edgec.signing import check_bundle_signature

    try:
        signer = check_bundle_signature(bundle, manifest, trust)
    except EdgecError as error:
        checks.append(Check("signature", "fail", str(error)))
        return False
    checks.append(Check("signature", "pass", f"manifest signed by trusted key {signer}"))
    return True


def _file_checks(bundle: Path, manifest: dict, checks: list[Check], signed: bool = False) -> None:
    listed = set(manifest["files"])
    extra = unlisted_entries(bundle, manifest)
    missing = []
    found = {}
    for name in sorted(listed):
        try:
            found[name] = listed_file(bundle, name)
        except BundleError as error:
            if "is missing" in str(error):
                missing.append(name)
            else:
                checks.append(Check(f"file {name}", "fail", str(error)))
    detail = "; ".join(
        filter(None, [missing and f"missing {', '.join(missing)}", extra and f"extra {', '.join(extra)}"])
    )
    checks.append(Check("file set", "fail" if detail else "pass", detail or f"{len(listed)} files, as listed"))
    changed = (
        "sha256 differs from the signed manifest: changed after signing"
        if signed
        else "sha256 differs from the manifest (damaged, or changed since the build)"
    )
    for name, path in found.items():
        entry = manifest["files"][name]
        size = path.stat().st_size
        if size != entry["size"]:
            checks.append(Check(f"file {name}", "fail", f"{size} bytes, manifest says {entry['size']} (truncated?)"))
        elif sha256_file(path) != entry["sha256"]:
            checks.append(Check(f"file {name}", "fail", changed))
        else:
            checks.append(Check(f"file {name}", "pass", f"sha256 ok, {size:,} bytes"))


def _graph_check(bundle: Path, manifest: dict, checks: list[Check]) -> None:
    """What the graph names (external data, op domains, inputs) against the bundle, read before any runtime."""
    from edgec.onnx_scan import graph_problems

    if any(check.status == "fail" for check in checks):
        checks.append(Check("graph", "skip", "earlier checks failed"))
        return
    problems = graph_problems(bundle, manifest)
    detail = "; ".join(problems[:3]) or "external data inside the bundle, known op domains, inputs match the cache"
    checks.append(Check("graph", "fail" if problems else "pass", detail))
    from edgec.runtime.tokenizer import BundleTokenizer

    try:
        tokenizer = BundleTokenizer(bundle / manifest["tokenizer"]["file"], None)
    except BundleError as error:
        checks.append(Check("tokenizer", "fail", str(error)))
        return
    checks.append(Check("tokenizer", "pass", f"{manifest['tokenizer']['file']} loads ({tokenizer.vocab_size} tokens)"))


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"[0-9]+", text.split("+")[0])[:3])


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
    if target.get("runtime") == "ort-cuda":  # ONNX Runtime's graph runs on any GPU from that capability on
        ok = _version_tuple(have) >= _version_tuple(str(wanted))
        return Check("gpu", "pass" if ok else "fail", f"this GPU is sm {have}, bundle needs {wanted} or newer")
    return Check("gpu", "pass" if have == str(wanted) else "fail", f"this GPU is sm {have}, bundle built for {wanted}")


def compare_with_reference(bundle: Path, manifest: dict) -> list[Check]:
    """Run the bundle on the build's validation prompts and compare with the logits the build recorded for this
    same bundle (same graph, same numbers: any difference beyond the kernels' rounding is damage); the error
    against the source model, a property of the quantization, is shown as recorded, not checked. Bundles from
    before the build recorded its own logits are compared with the source model's."""
    from edgec.runtime import Model

    if REFERENCE not in manifest["files"]:
        return [Check("reference logits", "skip", f"the bundle lists no {REFERENCE}")]
    model = Model.load(bundle)
    validation = manifest["validation"]
    stored = np.load(bundle / REFERENCE)
    own = "bundle_logits_0" in stored.files and isinstance(validation.get("compare_tolerance"), (int, float))
    if own:
        tolerance, against = float(validation["compare_tolerance"]), "its build-time output"
    else:
        tolerance, against = COMPARE_TOLERANCE.get(manifest["cache"]["dtype"], 1e-3), "the source model"
    checks = []
    for index in range(validation["prompts"]):
        ids, want = stored[f"ids_{index}"], stored[f"{'bundle_' if own else ''}logits_{index}"]
        got = model.next_token_logits(ids.tolist())
        error = float(np.abs(got - want).max())
        same_top1 = int(got.argmax()) == int(want.argmax())
        ok = error <= tolerance and same_top1
        checks.append(
            Check(
                f"reference logits, prompt {index}",
                "pass" if ok else "fail",
                f"max |Δ| {error:.2e} to {against} (tolerance {tolerance:g}), "
                f"top-1 {'same' if same_top1 else 'DIFFERS'}",
            )
        )
    if own:
        checks.append(
            Check(
                "error against the source model",
                "info",
                f"max |Δlogit| {validation['max_abs_logit_error']:.2e}, top-1 agreement "
                f"{validation['top1_agreement']:.0%} (recorded at build: what the weight format costs)",
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
    if REFERENCE not in manifest["files"]:
        return Check("cross-runtime", "skip", f"the bundle lists no {REFERENCE} to feed both runtimes")
    first, second = providers[:2]
    try:
        from polygraphy.backend.onnxrt import OnnxrtRunner, SessionFromOnnx
        from polygraphy.comparator import Comparator, CompareFunc
    except ImportError:
        return Check("cross-runtime", "skip", f"{second} present, but polygraphy is not: pip install polygraphy")
    # whole prompts: the graph that runs prompt chunks (a prefill graph's model.onnx takes one-token steps only)
    model_path = str(bundle / manifest["model"].get("prefill_file", manifest["model"]["file"]))
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
    graph_file = manifest["model"].get("prefill_file", manifest["model"]["file"])
    graph_inputs = {value.name for value in onnx.load(str(bundle / graph_file), load_external_data=False).graph.input}
    if manifest["format_version"] < 2:  # v1 named the state only in part: what the graph has
        spec = spec.keeping(graph_inputs)
    stored = np.load(bundle / REFERENCE)
    feeds = []
    for index in range(manifest["validation"]["prompts"]):
        ids = stored[f"ids_{index}"].astype(np.int64)
        feed = {
            "input_ids": ids[None],
            "position_ids": np.arange(len(ids))[None],
            "logits_index": np.array([len(ids) - 1]),
        }
        # a graph built before the `observe` input existed does not take it
        feeds.append(feed | {name: value for name, value in spec.empty_feeds(len(ids)).items() if name in graph_inputs})
    return feeds
