"""The ONNX Runtime CUDA targets (cuda, h100, h200): the cpu target's graph in fp16 — GroupQueryAttention on the
plain layers, the compressed cache as its function body — for onnxruntime-gpu's CUDAExecutionProvider. No GPU
here: the graph runs on ONNX Runtime's CPU provider by an explicit override and must generate what the cpu bundle
generates; what the CUDA provider itself would do (keep the cache on the GPU, leave nodes to the CPU, fail to
start) is checked through stand-ins of its session and of the driver. onnxruntime-gpu replaces the `onnxruntime`
module, so it lives in .venv-cuda (bash scripts/setup-cuda.sh); where that exists, loading there is checked too.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import tomllib
from click.testing import CliRunner

from edgec import targets
from edgec.build import BuildSettings, build
from edgec.cli import main
from edgec.errors import BuildError, BuildSettingsError, BundleError
from edgec.runtime import Model, backend_ort
from edgec.runtime.backend_ort import StateDevice, check_cuda_can_start, cuda_driver_problem, cuda_memory
from edgec.targets import load_target, parse_target
from tests.conftest import FP16_NEAR_TIE, assert_same_greedy, build_settings, make_llama_folder, manifest, pydoc_text
from tests.test_cli import assert_clean_failure

CPU = ["CPUExecutionProvider"]
CUDA_PYTHON = Path(__file__).resolve().parents[1] / ".venv-cuda" / "bin" / "python"
PROMPT = "def fibonacci(n):\n    return"


@pytest.fixture(scope="module")
def cuda_bundle(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("cuda") / "tiny.cuda.edgec"
    build(tiny_llama, out, BuildSettings(target="cuda", context=128, prefill_chunk=16))
    return out


def _long_prompt(model: Model) -> list[int]:
    return model.encode(pydoc_text()[:400])[:45]  # three prefill chunks of 16


def test_the_targets_share_one_graph_and_differ_in_memory():
    cuda, h100, h200 = (load_target(name) for name in ("cuda", "h100", "h200"))
    assert cuda.runtime == h100.runtime == h200.runtime == "ort-cuda"
    assert cuda.abilities == h100.abilities == h200.abilities
    assert cuda.optimizations == h100.optimizations == h200.optimizations
    assert cuda.abilities.compute == "fp16" and cuda.abilities.attention == "gqa"
    assert h100.compute_capability == h200.compute_capability == "9.0"  # the sm90 cards TensorRT-RTX cannot run
    assert cuda.memory_bytes < h100.memory_bytes < h200.memory_bytes
    assert all(target.buildable for target in (cuda, h100, h200))


def test_the_graph_is_the_cpu_graph_in_fp16(cuda_bundle, tiny_bundle):
    data = manifest(cuda_bundle)
    assert data["runtime"]["providers"] == ["CUDAExecutionProvider"]
    assert data["runtime"]["min_version"] == "1.23"  # CUDA kernels for RMSNormalization-23, RotaryEmbedding-23
    options = data["runtime"]["provider_options"]["CUDAExecutionProvider"]
    assert options == {"arena_extend_strategy": "kSameAsRequested"}  # the arena grows only by what is asked
    assert data["cache"]["dtype"] == "float16"
    assert set(data["passes"]) == set(manifest(tiny_bundle)["passes"]) | {"float16"}
    graph = onnx.load(str(cuda_bundle / "model.onnx"), load_external_data=False).graph
    types = {value.name: value.type.tensor_type.elem_type for value in [*graph.input, *graph.output]}
    types |= {value.name: value.type.tensor_type.elem_type for value in graph.value_info}
    attention = [node for node in graph.node if node.op_type == "GroupQueryAttention"]
    assert len(attention) == 2  # every plain layer
    for node in attention:  # fp16 in and out: ORT's CUDA GroupQueryAttention has no fp32 kernel
        assert types[node.input[3]] == types[node.output[1]] == onnx.TensorProto.FLOAT16
    assert types["logits"] == onnx.TensorProto.FLOAT16


def test_same_greedy_tokens_as_the_cpu_bundle(cuda_bundle, tiny_bundle):
    cpu = Model.load(tiny_bundle)
    cuda = Model.load(cuda_bundle, providers=CPU)
    assert cuda.providers == CPU
    for prompt in (PROMPT, _long_prompt(cpu)):  # its cache is fp16: a near tie may go the other way
        assert_same_greedy(cpu, cuda, prompt, max_new_tokens=24, near_tie=FP16_NEAR_TIE)


def test_fp32_and_fp8_weights_are_refused_with_the_reason(tiny_llama, tmp_path):
    for weights in ("fp32", "fp8"):
        with pytest.raises(BuildSettingsError, match=f"cuda has no {weights}|--weights fp8 needs"):
            build(tiny_llama, tmp_path / weights, BuildSettings(target="cuda", context=128, weights=weights))
        assert not (tmp_path / weights).exists()


def test_compressed_cache_runs_as_on_the_cpu(tiny_llama, tmp_path):
    settings = dict(context=128, prefill_chunk=16, kv_capacity=40, kv_window=8, kv_group=16, kv_dtype="int8")
    cpu = tmp_path / "cpu.edgec"
    cuda = tmp_path / "cuda.edgec"
    build(tiny_llama, cpu, build_settings(target="cpu", **settings))
    build(tiny_llama, cuda, build_settings(target="cuda", **settings))
    prompt = _long_prompt(Model.load(cpu))
    want = list(Model.load(cpu).generate_ids(prompt, max_new_tokens=16))
    assert list(Model.load(cuda, providers=CPU).generate_ids(prompt, max_new_tokens=16)) == want


def test_without_onnxruntime_gpu_one_line_names_the_extra(cuda_bundle):
    with pytest.raises(BundleError) as error:
        Model.load(cuda_bundle)  # this venv's onnxruntime has no CUDAExecutionProvider
    message = str(error.value)
    assert "CUDAExecutionProvider" in message and "pip install 'edgec[cuda]'" in message and "\n" not in message
    assert_clean_failure(CliRunner().invoke(main, ["run", str(cuda_bundle), "hello"]), "edgec[cuda]")


def test_jetson_orin_stays_plan_only_and_says_why(tiny_llama, tmp_path):
    jetson = load_target("jetson-orin")
    assert jetson.runtime == "ort-cuda" and not jetson.buildable
    with pytest.raises(BuildSettingsError, match="JetPack"):
        build(tiny_llama, tmp_path / "x", BuildSettings(target="jetson-orin", context=128))
    assert not (tmp_path / "x").exists()
    data = tomllib.loads((Path(targets.__file__).parent / "jetson-orin.toml").read_text())
    assert parse_target("jetson-orin", {k: v for k, v in data.items() if k != "plan_only"}).buildable
    with pytest.raises(BuildSettingsError, match="plan_only must be a sentence"):
        parse_target("jetson-orin", {**data, "plan_only": " "})


# --- what the CUDA provider does, through stand-ins ------------------------------------------------------------
class StandInCudaSession:
    """A real CPU session that reports what ONNX Runtime's CUDA provider would: CUDA first, some nodes left to the
    CPU (or, with ``started=False``, a provider that failed to start, as ORT does when a library is missing)."""

    started = True
    on_cpu = ("Shape", "ReduceMax", "ReduceMax", "Cast")
    options: list = []

    def __init__(self, path, options, providers, provider_options):
        StandInCudaSession.options.append((providers, provider_options))
        self._session = REAL_SESSION(path, options, providers=CPU)

    def get_providers(self):
        return ["CUDAExecutionProvider", *CPU] if self.started else CPU

    def get_provider_graph_assignment_info(self):
        nodes = [SimpleNamespace(op_type=op) for op in self.on_cpu]
        return [
            SimpleNamespace(ep_name="CUDAExecutionProvider", get_nodes=lambda: [SimpleNamespace(op_type="MatMul")]),
            SimpleNamespace(ep_name="CPUExecutionProvider", get_nodes=lambda: nodes),
        ]

    def __getattr__(self, name):
        return getattr(self._session, name)


REAL_SESSION = ort.InferenceSession


@pytest.fixture
def stand_in_cuda(monkeypatch):
    """ONNX Runtime with a CUDA provider on a GPU machine, as far as the runtime can see; device buffers are host
    buffers here, and every state allocation is recorded with the device it asked for."""
    devices = []
    real_from_numpy = ort.OrtValue.ortvalue_from_numpy

    def from_numpy(array, device_type="cpu", device_id=0, *rest):
        devices.append((device_type, device_id))
        return real_from_numpy(array)

    monkeypatch.setattr(ort, "get_available_providers", lambda: ["CUDAExecutionProvider", *CPU])
    monkeypatch.setattr(backend_ort, "check_cuda_can_start", lambda: None)
    monkeypatch.setattr(backend_ort.ort, "InferenceSession", StandInCudaSession)
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(from_numpy))
    StandInCudaSession.started = True
    StandInCudaSession.options = []
    return devices


def test_on_the_gpu_the_cache_lives_on_the_device_and_cpu_nodes_are_named(
    cuda_bundle, tiny_bundle, stand_in_cuda, caplog
):
    with caplog.at_level(logging.WARNING, logger="edgec.runtime"):
        model = Model.load(cuda_bundle)
    assert model.providers[0] == "CUDAExecutionProvider"
    notes = [record.getMessage() for record in caplog.records]
    assert notes == [
        "note: CUDAExecutionProvider left 4 node(s) of model.onnx to the CPU (ReduceMax ×2, Shape ×1, Cast ×1)"
    ]
    got = list(model.generate_ids(PROMPT, max_new_tokens=12))
    assert got == list(Model.load(tiny_bundle).generate_ids(PROMPT, max_new_tokens=12))
    state_tensors = len(model.cache_spec.empty_state())
    assert stand_in_cuda.count(("cuda", 0)) == state_tensors  # every cache tensor allocated on the GPU, once
    assert StandInCudaSession.options[0] == (["CUDAExecutionProvider"], [{"arena_extend_strategy": "kSameAsRequested"}])


def test_no_device_memory_for_an_end_prompt_s_state_is_one_line(tiny_llama, tmp_path, stand_in_cuda, monkeypatch):
    """On the CUDA provider an `end` prompt's temporary state is allocated on the GPU at once: where the device
    has no room ONNX Runtime's allocation error becomes one line naming prefill_compress='chunk', and the model
    keeps working for prompts that fit the slots."""
    from edgec.errors import GenerationError

    out = tmp_path / "cuda.kv.edgec"
    build(tiny_llama, out, build_settings(target="cuda", context=128, prefill_chunk=16, kv_capacity=40, kv_window=8))
    model = Model.load(out)
    prompt = _long_prompt(model)
    want = list(model.generate_ids(prompt, max_new_tokens=4))
    allocate = ort.OrtValue.ortvalue_from_numpy

    def full_device(array, device_type="cpu", device_id=0, *rest):
        if device_type == "cuda" and array.shape[2] > 40:  # the prompt's state, not the slots' (40 or 41 rows)
            raise RuntimeError("CUDA failure 2: out of memory ; GPU=0 ; hostname=x ; file=cuda_allocator.cc")
        return allocate(array, device_type, device_id, *rest)

    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(full_device))
    with pytest.raises(GenerationError, match=r"no cuda memory for a 45-token prompt's .*out of memory.*'chunk'"):
        list(model.generate_ids(prompt, max_new_tokens=4))
    assert list(model.generate_ids(prompt[:30], max_new_tokens=4))
    monkeypatch.setattr(ort.OrtValue, "ortvalue_from_numpy", staticmethod(allocate))
    assert list(model.generate_ids(prompt, max_new_tokens=4)) == want


def test_a_provider_that_fails_to_start_is_an_error_not_a_cpu_run(cuda_bundle, stand_in_cuda):
    StandInCudaSession.started = False  # what ONNX Runtime does when libcublas is missing: log, then use the CPU
    with pytest.raises(BundleError) as error:
        Model.load(cuda_bundle)
    message = str(error.value)
    assert "could not start its CUDAExecutionProvider" in message and "\n" not in message


def test_the_state_device_follows_the_provider_and_its_device_id():
    assert StateDevice.for_providers(["CUDAExecutionProvider"], None) == ("cuda", 0)
    assert StateDevice.for_providers(["CUDAExecutionProvider"], {"CUDAExecutionProvider": {"device_id": "1"}}) == (
        "cuda",
        1,
    )
    assert StateDevice.for_providers(CPU, None) == ("cpu", 0)
    assert StateDevice.for_providers(["OpenVINOExecutionProvider"], None) == ("cpu", 0)  # it reads host buffers


class FakeDriver:
    def __init__(self, init_status=0, devices=1):
        self.init_status, self.devices = init_status, devices

    def cuInit(self, flags):  # noqa: N802 (the driver's own name)
        return self.init_status

    def cuDeviceGetCount(self, count):  # noqa: N802
        count._obj.value = self.devices
        return 0


def _loader(driver):
    def load(name):
        if driver is None:
            raise OSError(f"{name}: cannot open shared object file")
        return driver

    return load


def test_the_driver_probe_names_what_is_missing():
    assert "no NVIDIA driver" in cuda_driver_problem(_loader(None))
    assert "cuInit returned CUDA error 100" in cuda_driver_problem(_loader(FakeDriver(init_status=100)))
    assert "reports no GPU" in cuda_driver_problem(_loader(FakeDriver(devices=0)))
    assert cuda_driver_problem(_loader(FakeDriver())) is None


class FakeContextDriver(FakeDriver):
    """The driver calls ``cuda_memory`` makes, recording the context it makes current and releases."""

    def __init__(self, free=6 << 30, total=8 << 30, meminfo_status=0, **options):
        super().__init__(**options)
        self.free, self.total, self.meminfo_status = free, total, meminfo_status
        self.calls: list[str] = []

    def cuDeviceGet(self, device, index):  # noqa: N802
        device._obj.value = index.value
        self.calls.append(f"get {index.value}")
        return 0

    def cuDevicePrimaryCtxRetain(self, context, device):  # noqa: N802
        context._obj.value = 0xC0
        self.calls.append(f"retain {device.value}")
        return 0

    def cuCtxPushCurrent_v2(self, context):  # noqa: N802
        self.calls.append("push")
        return 0

    def cuMemGetInfo_v2(self, free, total):  # noqa: N802
        free._obj.value, total._obj.value = self.free, self.total
        return self.meminfo_status

    def cuCtxPopCurrent_v2(self, context):  # noqa: N802
        self.calls.append("pop")
        return 0

    def cuDevicePrimaryCtxRelease_v2(self, device):  # noqa: N802
        self.calls.append(f"release {device.value}")
        return 0


def test_the_cuda_provider_s_free_memory_comes_from_the_driver_in_the_primary_context():
    """``edgec serve`` budgets a CUDA bundle's sessions against the GPU's free memory; ONNX Runtime does not report
    it, so the driver is asked inside the device's primary context (the one ONNX Runtime's CUDA runtime uses),
    which is retained and released, pushed and popped — never a context of its own, never left current."""
    driver = FakeContextDriver()
    assert cuda_memory(1, _loader(driver)) == (6 << 30, 8 << 30)
    assert driver.calls == ["get 1", "retain 1", "push", "pop", "release 1"]
    failing = FakeContextDriver(meminfo_status=201)
    assert cuda_memory(0, _loader(failing)) is None and failing.calls[-2:] == ["pop", "release 0"]
    assert cuda_memory(0, _loader(None)) is None  # no driver: nothing to say
    assert cuda_memory(0, _loader(FakeContextDriver(init_status=100))) is None
    assert cuda_memory(0, _loader(FakeDriver())) is None  # a driver without these entry points


def test_which_backends_report_a_gpu_s_memory(tiny_bundle, monkeypatch):
    asked = []
    monkeypatch.setattr(backend_ort, "cuda_memory", lambda index: asked.append(index) or (1, 2))
    assert backend_ort._device_memory(StateDevice("cuda", 1)) == (1, 2) and asked == [1]
    assert backend_ort._device_memory(StateDevice()) is None
    with Model.load(tiny_bundle) as model:  # the cpu target's states live in host memory
        assert model.device_memory() is None and asked == [1]


def test_a_missing_cuda_library_is_one_line_before_onnx_runtime_tries(monkeypatch):
    monkeypatch.setattr(backend_ort, "cuda_driver_problem", lambda: None)

    def preload():  # onnxruntime-gpu's preload_dlls reports each required library it cannot load, on stdout
        print("Failed to load libcublasLt.so.13: libcublasLt.so.13: cannot open shared object file")
        print("Failed to load libcublas.so.13: libcublas.so.13: cannot open shared object file")
        print("Please follow https://onnxruntime.ai/docs/install/#cuda-and-cudnn to install CUDA.")

    monkeypatch.setattr(backend_ort.ort, "preload_dlls", preload, raising=False)
    with pytest.raises(BundleError) as error:
        check_cuda_can_start()
    message = str(error.value)
    assert "needs libcublasLt.so.13" in message and "2 CUDA libraries missing" in message and "\n" not in message
    monkeypatch.setattr(backend_ort.ort, "preload_dlls", lambda: None, raising=False)
    check_cuda_can_start()  # everything loads: nothing to say
    monkeypatch.setattr(backend_ort, "cuda_driver_problem", lambda: "no NVIDIA driver here (libcuda.so.1 …)")
    with pytest.raises(BundleError, match="runs on an NVIDIA GPU.*no NVIDIA driver"):
        check_cuda_can_start()


@pytest.mark.skipif(not CUDA_PYTHON.exists(), reason="no .venv-cuda (bash scripts/setup-cuda.sh)")
def test_onnxruntime_gpu_without_a_gpu_is_one_error_line(cuda_bundle, tmp_path):
    """In .venv-cuda (onnxruntime-gpu installed, no GPU here) the CUDA provider is available but cannot start:
    edgec's command line says so in one line instead of running on the CPU."""
    bundle = shutil.copytree(cuda_bundle, tmp_path / "b.edgec")
    done = subprocess.run(
        [str(CUDA_PYTHON), "-m", "edgec.runtime", str(bundle), "hello"], capture_output=True, text=True, timeout=300
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    assert "NVIDIA" in lines[0] or "CUDA" in lines[0]
    providers = subprocess.run(
        [str(CUDA_PYTHON), "-c", "import json, onnxruntime as o; print(json.dumps(o.get_available_providers()))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "CUDAExecutionProvider" in json.loads(providers.stdout)  # onnxruntime-gpu imports without a GPU


def test_verify_takes_the_targets_capability_as_a_floor(monkeypatch):
    """An ONNX Runtime CUDA bundle runs on any GPU from its target's compute capability on (an engine only on its
    own): `edgec verify` says so."""
    from edgec.verify import _gpu_check

    capability = [(9, 0)]
    fake = SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetCudaComputeCapability=lambda handle: capability[0],
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    cuda = load_target("cuda").to_json()
    assert _gpu_check(cuda).status == "pass"  # an H200 runs the `cuda` bundle
    capability[0] = (6, 1)
    assert _gpu_check(cuda).status == "fail"
    capability[0] = (8, 9)
    assert _gpu_check(load_target("rtx3060").to_json()).status == "fail"  # an sm86 engine needs sm86


def test_a_model_whose_activations_overflow_fp16_is_refused_with_the_reason(tiny_tokenizer, tmp_path):
    """Gemma-3-270m's residual stream reaches ~1e5 (measured: 103,795 at layer 14), past fp16's 65,504: its fp16
    graph gives NaN logits. The build says why in one line instead of failing on a NaN in the manifest. Here a
    tiny Llama with weights 100× larger overflows the same way."""
    import torch
    from safetensors.torch import load_file, save_file

    folder = make_llama_folder(tmp_path / "loud", tiny_tokenizer)
    weights = folder / "model.safetensors"
    tensors = {name: value * 100 if value.dim() == 2 else value for name, value in load_file(weights).items()}
    save_file({name: value.to(torch.float32).contiguous() for name, value in tensors.items()}, weights)
    with pytest.raises(BuildError, match="overflow fp16"):
        build(folder, tmp_path / "out", BuildSettings(target="cuda", context=128))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_quantized_weights_run_in_the_fp16_graph(tiny_llama, tmp_path, weights):
    """MatMulNBits (and the shared 8-bit GatherBlockQuantized table) in the fp16 graph: ONNX Runtime's CUDA kernels
    take fp16 activations with 4- and 8-bit weights. Here on the CPU provider against the cpu bundle with the same
    weights and fp32 activations (--accuracy-level 1): within fp16's error (measured 0.07 on logits of range 3-4;
    greedy tokens of this random model can part at near-ties, so they are not compared)."""
    cpu, cuda = tmp_path / "cpu.edgec", tmp_path / "cuda.edgec"
    build(
        tiny_llama, cpu, BuildSettings(target="cpu", context=128, prefill_chunk=16, weights=weights, accuracy_level=1)
    )
    build(tiny_llama, cuda, BuildSettings(target="cuda", context=128, prefill_chunk=16, weights=weights))
    graph = onnx.load(str(cuda / "model.onnx"), load_external_data=False).graph
    assert any(node.op_type == "MatMulNBits" for node in graph.node)
    reference, model = Model.load(cpu), Model.load(cuda, providers=CPU)
    for prompt in (PROMPT, _long_prompt(reference)):
        want = reference.next_token_logits(prompt)
        got = model.next_token_logits(prompt).astype(np.float32)
        assert np.abs(got - want).max() < 0.15


def test_a_gpu_bundle_s_prompt_session_keeps_its_memory_pattern(tiny_llama, tmp_path, stand_in_cuda):
    """Prompt-chunk sessions plan no ONNX Runtime memory pattern on the CPU (``PROMPT_MEMORY_PATTERN``, measured
    there); a GPU bundle's, where it was not measured, keeps its, as the one-token session does."""
    settings = dict(context=128, prefill_chunk=16, kv_capacity=40, kv_window=8, kv_dtype="fp32")
    cuda = tmp_path / "cuda.fp32-slots.edgec"
    build(tiny_llama, cuda, build_settings(target="cuda", **settings))
    on_gpu = Model.load(cuda)
    assert on_gpu.providers[0] == "CUDAExecutionProvider" and on_gpu._backend.prefill is not None
    assert on_gpu._backend.prefill.session.get_session_options().enable_mem_pattern is True
    assert on_gpu._backend.graph.session.get_session_options().enable_mem_pattern is True
    on_cpu = Model.load(cuda, providers=CPU)
    assert on_cpu._backend.prefill.session.get_session_options().enable_mem_pattern is False
