"""The TensorRT-RTX backend end to end without a GPU: tests/fakes stand in for tensorrt_rtx and the CUDA runtime,
executing the engine's own ONNX graph with ONNX Runtime over device buffers kept in host memory — so every
binding, shape, dtype, buffer swap and copy of the backend runs here (benchmarks/gpu_check.sh runs the real one)."""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from click.testing import CliRunner

from edgec.build import BuildSettings, build
from edgec.cli import main
from edgec.errors import BundleError
from edgec.kvcache.spec import CacheSpec
from edgec.runtime import Model
from edgec.runtime.backend_ort import open_backend
from tests.conftest import build_settings, manifest, pydoc_text
from tests.fakes import cudart
from tests.fakes import tensorrt_rtx as fake_trt
from tests.test_cli import assert_clean_failure

pytest.importorskip("tensorrt_rtx", reason="tensorrt-rtx builds the engines (pip install 'edgec[tensorrt-rtx]')")


@pytest.fixture(scope="module")
def rtx_bundle(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("rtx") / "tiny.rtx3060.edgec"
    build(tiny_llama, out, BuildSettings(target="rtx3060", context=128, prefill_chunk=16))
    return out


@pytest.fixture
def fake_gpu(monkeypatch, tmp_path):
    """The fake tensorrt_rtx and cuda.bindings.runtime in place of the real modules; one RTX 3060."""
    cudart.reset()
    bindings = types.ModuleType("cuda.bindings")
    bindings.runtime = cudart
    cuda = types.ModuleType("cuda")
    cuda.bindings = bindings
    for name, module in (("cuda", cuda), ("cuda.bindings", bindings), ("cuda.bindings.runtime", cudart)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", fake_trt)
    monkeypatch.setenv("EDGEC_CACHE_DIR", str(tmp_path / "cache"))
    fake_trt.RUNS.clear()
    yield
    leaked = cudart.leaked_after_collection()
    cudart.reset()
    assert leaked is None, leaked


def _register(bundle) -> None:
    record = manifest(bundle)
    fake_trt.register(bundle / "engine.trt", bundle / "model.onnx", record["model"]["context"])


def _graph_state(bundle):
    """A cache state of the bundle's own graph on the ONNX Runtime backend (what the engine was built from)."""
    record = manifest(bundle)
    spec = CacheSpec.from_json(record["cache"])
    return open_backend(bundle, record["model"], spec, 16, ["CPUExecutionProvider"]).open_state()


def _graph_greedy(bundle, prompt_ids: list[int], steps: int) -> list[int]:
    state = _graph_state(bundle)
    ids, tokens = np.asarray(prompt_ids, np.int64), []
    logits = np.concatenate([state.run(ids[s : s + 16], s, last_only=True) for s in range(0, len(ids), 16)])[-1]
    for position in range(len(ids), len(ids) + steps):
        tokens.append(int(logits.argmax()))
        logits = state.run(np.array([tokens[-1]]), position, last_only=True)[-1].copy()
    return tokens


def test_the_backend_runs_the_engine_and_gives_its_graphs_tokens(rtx_bundle, tiny_bundle, fake_gpu):
    """Loads (the loader of every earlier release failed on the second state tensor), binds every tensor, swaps
    state buffers, and gives exactly the tokens of the graph the engine was built from; the fp32 cpu bundle
    agrees on the greedy path too."""
    _register(rtx_bundle)
    model = Model.load(rtx_bundle)
    assert model.providers == ["TensorRT-RTX"]
    text = pydoc_text()
    for prompt in (text[:40], text[500:620], "def fibonacci(n):\n    "):
        ids = model.encode(prompt)
        got = list(model.generate_ids(ids, max_new_tokens=20))
        assert got == _graph_greedy(rtx_bundle, ids, len(got))
        assert got == list(Model.load(tiny_bundle).generate_ids(ids, max_new_tokens=20))
    assert fake_trt.RUNS and set(fake_trt.RUNS) == {str(rtx_bundle / "model.onnx")}  # it really ran the engine


def test_logprobs_through_the_engine_match_the_graph(rtx_bundle, fake_gpu):
    _register(rtx_bundle)
    model = Model.load(rtx_bundle)
    ids = np.asarray(model.encode(pydoc_text()[:2000])[:100])  # several 16-token steps
    state = _graph_state(rtx_bundle)
    logits = np.concatenate([state.run(ids[s : s + 16], s, last_only=False) for s in range(0, 100, 16)])
    logits = logits.astype(np.float64)
    peak = logits.max(-1, keepdims=True)
    log_softmax = logits - peak - np.log(np.exp(logits - peak).sum(-1, keepdims=True))
    np.testing.assert_allclose(model.logprobs(ids.tolist()), log_softmax[np.arange(99), ids[1:]], atol=1e-6)


def test_every_buffer_is_freed_and_the_runtime_cache_kept(rtx_bundle, fake_gpu, tmp_path):
    _register(rtx_bundle)
    with Model.load(rtx_bundle) as model:
        model.generate("x = 1", max_new_tokens=3)
        assert cudart.ALLOCATIONS and cudart.STREAMS
    assert not cudart.ALLOCATIONS and not cudart.STREAMS  # every cudaMalloc freed, every stream destroyed
    kept = list((tmp_path / "cache" / "tensorrt-rtx").glob("*.cache"))
    assert len(kept) == 1 and kept[0].read_bytes().startswith(b"fake-runtime-cache")
    with Model.load(rtx_bundle) as again:  # the next start reads it back
        assert again._backend.runtime_cache.blob.startswith(b"fake-runtime-cache")


def test_no_gpu_is_one_line(rtx_bundle, fake_gpu):
    _register(rtx_bundle)
    cudart.reset(devices=[])
    with pytest.raises(BundleError, match=r"NVIDIA GPU of compute capability 8\.6; none is usable here"):
        Model.load(rtx_bundle)
    result = CliRunner().invoke(main, ["run", str(rtx_bundle), "hello"])
    assert_clean_failure(result, "compute capability 8.6")


def test_a_driver_too_old_for_the_cuda_build_is_named(rtx_bundle, fake_gpu):
    cudart.reset(driver=12080)  # an R570 driver: CUDA 12.8
    with pytest.raises(BundleError, match=r"supports CUDA 12\.8, the installed TensorRT-RTX needs CUDA 13\.0"):
        Model.load(rtx_bundle)


def test_another_gpu_or_release_is_named(rtx_bundle, fake_gpu):
    cudart.reset(devices=[cudart.cudaDeviceProp(name=b"Fake RTX 4090", major=8, minor=9)])
    with pytest.raises(BundleError, match=r"built for compute capability 8\.6; this GPU \(Fake RTX 4090\) is 8\.9"):
        Model.load(rtx_bundle)
    cudart.reset()
    fake_trt.ENGINES.clear()  # an engine this TensorRT-RTX does not accept
    with pytest.raises(BundleError, match="cannot run here.*rebuild"):
        Model.load(rtx_bundle)


def test_missing_libraries_name_the_extra(rtx_bundle, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorrt_rtx", None)
    with pytest.raises(BundleError, match=r"pip install 'edgec\[tensorrt-rtx\]'"):
        Model.load(rtx_bundle)


@pytest.fixture(scope="module")
def compressed_rtx_bundle(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("rtx-kv") / "tiny.rtx3060.kv.edgec"
    settings = build_settings(
        target="rtx3060", context=128, prefill_chunk=16, kv_capacity=40, kv_window=8, kv_dtype="int8", kv_group=16
    )
    build(tiny_llama, out, settings)
    return out


def _on_onnx_runtime(bundle, copy):
    """The same bundle with its runtime section pointing at ONNX Runtime's CPU provider: the graph the engine was
    built from, run by the ONNX Runtime backend with the same prompt handling."""
    import json
    import shutil

    shutil.copytree(bundle, copy)
    record = json.loads((copy / "manifest.json").read_text())
    runtime = record["runtime"]
    record["runtime"] = {
        "library": "onnxruntime",
        "min_version": "1.20",
        "providers": ["CPUExecutionProvider"],
        "prefill_chunk": runtime["prefill_chunk"],
        "protect": runtime["protect"],
    }
    (copy / "manifest.json").write_text(json.dumps(record))
    return Model.load(copy)


def _generation_logits(model: Model, ids: list[int], tokens: list[int]) -> list[np.ndarray]:
    """The logits before each of ``tokens`` when they are generated after ``ids`` (prefill, then one per step)."""
    with model._state() as state:
        rows = [model._prefill(state, np.asarray(ids), all_logits=False)[-1].astype(np.float32)]
        for offset, token in enumerate(tokens[:-1]):
            rows.append(state.run(np.array([token]), len(ids) + offset, last_only=True)[-1].astype(np.float32))
    return rows


def test_compressed_cache_on_tensorrt_rtx(compressed_rtx_bundle, tiny_llama, tmp_path, fake_gpu):
    """The compressed cache builds into a TensorRT-RTX engine (int8 slots, every-slot body, fp32 inside) and runs
    through the backend — a prompt longer than the capacity is read whole into larger device buffers, then
    selected — giving exactly its graph's tokens; against the fp32 cpu bundle with the same settings, every greedy
    step picks the same token unless the cpu's top two are closer than fp16 computes (a tie, not a fault)."""
    record = manifest(compressed_rtx_bundle)
    assert record["validation"]["top1_agreement"] == 1.0
    assert all(layer["compressed"] and "score" in layer["state"] for layer in record["cache"]["layers"])
    _register(compressed_rtx_bundle)
    model = Model.load(compressed_rtx_bundle)
    graph = _on_onnx_runtime(compressed_rtx_bundle, tmp_path / "graph.edgec")
    cpu = tmp_path / "tiny.cpu.kv.edgec"
    kv = dict(kv_capacity=40, kv_window=8, kv_dtype="int8", kv_group=16)
    build(tiny_llama, cpu, build_settings(context=128, prefill_chunk=16, **kv))
    cpu_model = Model.load(cpu)
    text = pydoc_text()
    ties = 0
    for prompt in (text[:60], text[1000:1250]):  # 28 and 123 tokens: evicting while decoding, and a long prompt
        ids = model.encode(prompt)
        got = list(model.generate_ids(ids, max_new_tokens=16))
        assert got == list(graph.generate_ids(ids, max_new_tokens=16))
        want = list(cpu_model.generate_ids(ids, max_new_tokens=16))
        # teacher-forced on the cpu's tokens, through the same path as generation (prefill, then one token a step)
        for step, (ours, theirs) in enumerate(
            zip(_generation_logits(model, ids, want), _generation_logits(cpu_model, ids, want), strict=True)
        ):
            top_two = np.sort(theirs)[-2:]
            if int(ours.argmax()) != want[step]:
                ties += 1
                assert top_two[1] - top_two[0] < 2 * np.abs(ours - theirs).max(), f"step {step} differs, no tie"
    assert ties <= 2
    assert not [p for p in cudart.ALLOCATIONS.values() if p.nbytes > 1 << 20]  # the larger prompt state was freed


def test_only_the_last_chunk_of_a_long_prompt_observes_on_the_engine(compressed_rtx_bundle, fake_gpu, monkeypatch):
    """The engine takes the op's `observe` input and the backend feeds it as the ONNX Runtime one does
    (edgec/runtime/observe.py): False for every chunk of an `end` prompt but the last, True for one-token steps."""
    from edgec.runtime.observe import PromptObservation

    fed: list[bool] = []
    original = PromptObservation.observes

    def observes(self, newest: int) -> bool:
        fed.append(original(self, newest))
        return fed[-1]

    monkeypatch.setattr(PromptObservation, "observes", observes)
    _register(compressed_rtx_bundle)
    model = Model.load(compressed_rtx_bundle)
    assert model._backend.observes
    ids = model.encode(pydoc_text()[1000:1250])[:70]  # 70 tokens, 16-token chunks: 6, then four of 16
    list(model.generate_ids(ids, max_new_tokens=3))
    assert fed == [False] * 4 + [True] * 3  # the last chunk, then two one-token steps


def test_a_saved_prompt_restores_into_device_buffers(compressed_rtx_bundle, tmp_path, fake_gpu):
    """save_state downloads the engine's cache state after a prompt longer than the capacity; another Model
    uploads it (TrtCacheState.restore) and generates the cold run's tokens without reading the prompt."""
    _register(compressed_rtx_bundle)
    model = Model.load(compressed_rtx_bundle)
    ids = model.encode(pydoc_text()[1000:1250])
    model.save_state(tmp_path / "prompt.edgeckv", ids)
    cold = list(model.generate_ids(ids, max_new_tokens=12))
    other = Model.load(compressed_rtx_bundle)
    saved = other.load_state(tmp_path / "prompt.edgeckv")
    other._prefill = None  # reading the prompt again would fail
    assert list(other.generate_ids(ids, max_new_tokens=12, saved=saved)) == cold


@pytest.fixture(scope="module")
def gemma_rtx_bundle(tmp_path_factory, tiny_gemma3):
    """Sliding-window rings beside one compressed global layer (Gemma 3's layout), on TensorRT-RTX."""
    out = tmp_path_factory.mktemp("rtx-gemma") / "gemma3.rtx3060.kv.edgec"
    settings = build_settings(target="rtx3060", context=96, prefill_chunk=16, kv_capacity=40, kv_window=8)
    build(tiny_gemma3[0], out, settings)
    return out


def test_an_end_prompt_s_device_state_is_the_compressed_layers_alone_and_freed_each_prompt(
    gemma_rtx_bundle, tmp_path, fake_gpu
):
    """An `end` prompt's temporary device state holds the compressed layer alone (the rings keep their buffers,
    which the prompt fills), is exactly what ``session_bytes`` prices, and is freed when each prompt ends — before,
    both buffers of every ring were allocated again for each prompt and kept until the state closed (a served
    Gemma leaked ~16 MB of GPU memory a prompt). The tokens are the engine graph's on ONNX Runtime."""
    record = manifest(gemma_rtx_bundle)
    assert [layer.get("compressed", False) for layer in record["cache"]["layers"]] == [False, False, True, False]
    _register(gemma_rtx_bundle)
    model = Model.load(gemma_rtx_bundle)
    graph = _on_onnx_runtime(gemma_rtx_bundle, tmp_path / "graph.edgec")
    loaded = cudart.used_bytes()
    with model._state():  # the first state: opened here, then kept in the pool
        assert cudart.used_bytes() - loaded == model.session_bytes()
    steady = cudart.used_bytes()
    rng = np.random.default_rng(2)
    for length in (60, 75, 60):
        ids = rng.integers(0, model.vocab_size, length).tolist()
        cudart.reset_peak()
        got = list(model.generate_ids(ids, max_new_tokens=6))
        assert cudart.PEAK[0] - steady == model.session_bytes(prompt_tokens=length) - model.session_bytes()
        assert cudart.used_bytes() == steady  # nothing of the prompt's state is left on the device
        assert got == list(graph.generate_ids(ids, max_new_tokens=6))
    state = model._idle[-1].arrays()
    for layer in (0, 1, 3):  # the rings hold the last prompt's last 32 tokens and the generated ones
        assert (state[f"cache.{layer}.pos"] >= 0).sum() == 32


def test_an_end_prompt_without_room_on_the_gpu_is_one_line(gemma_rtx_bundle, fake_gpu, monkeypatch):
    """The temporary state's two device buffers per tensor are checked against the GPU's free memory before any
    is allocated (one line naming prefill_compress='chunk'); memory taken between the check and the allocation
    (another process) is one line too, and what was allocated is freed. The state stays usable."""
    from edgec.errors import GenerationError

    _register(gemma_rtx_bundle)
    model = Model.load(gemma_rtx_bundle)
    ids = np.random.default_rng(3).integers(0, model.vocab_size, 60).tolist()
    want = list(model.generate_ids(ids, max_new_tokens=4))
    steady = cudart.used_bytes()
    needed = model.session_bytes(prompt_tokens=60) - model.session_bytes()
    cudart.DEVICES[0].totalGlobalMem = steady + needed - 1
    with pytest.raises(GenerationError, match=r"60-token prompt is read whole .* free on the GPU.*'chunk'") as error:
        list(model.generate_ids(ids, max_new_tokens=4))
    assert "\n" not in str(error.value) and cudart.used_bytes() == steady
    assert list(model.generate_ids(ids[:30], max_new_tokens=4))  # fits the 40 slots: no temporary state
    monkeypatch.setattr(cudart, "cudaMemGetInfo", lambda: (cudart.cudaError_t.cudaSuccess, 1 << 40, 1 << 40))
    with pytest.raises(GenerationError, match="no GPU memory for a 60-token prompt's state .*cudaErrorMemoryAlloc"):
        list(model.generate_ids(ids, max_new_tokens=4))  # the check passed, the allocation failed part-way
    assert cudart.used_bytes() == steady
    cudart.DEVICES[0].totalGlobalMem = steady + needed
    assert list(model.generate_ids(ids, max_new_tokens=4)) == want  # exactly enough


def test_edgec_serve_budgets_the_gpu_that_holds_the_sessions(compressed_rtx_bundle, fake_gpu):
    """A TensorRT-RTX bundle's sessions live in GPU memory: the server measures the GPU after its warm-up and admits
    sessions against what is free there: as many as the device holds beside the server's headroom, not one more."""
    import asyncio

    from edgec.serve import load_server, start_line
    from edgec.serve.memory import HEADROOM
    from edgec.serve.scheduler import Busy

    _register(compressed_rtx_bundle)
    probe = Model.load(compressed_rtx_bundle)
    session = probe.session_bytes()
    probe.close()
    assert cudart.used_bytes() == 0
    cudart.DEVICES[0].totalGlobalMem = HEADROOM + 3 * session + session // 2  # room for three sessions, not four
    server = load_server(compressed_rtx_bundle, max_sessions=8, queue_size=0, max_prompt_tokens=40)
    memory = server.memory
    assert memory.budget_on == "gpu" and memory.device_used == cudart.used_bytes() == 0  # the warm-up's state freed
    assert memory.session_budget == memory.device_total - memory.device_used - HEADROOM
    line = start_line(server, "127.0.0.1", 8000)
    assert f"{memory.session_budget / 2**20:,.0f} MiB of GPU memory for sessions' caches" in line
    assert "0 of 32 MiB in use on the GPU after the warm-up" in line and "up to 8 sessions" in line

    async def admit_all():
        tickets = []
        with pytest.raises(Busy):
            while True:
                tickets.append(await server.scheduler.admit(8))
        return tickets

    tickets = asyncio.run(admit_all())
    assert len(tickets) == 3 and all(ticket.bytes == session for ticket in tickets)
    states = [server.model._backend.open_state() for _ in tickets]  # the device holds what was admitted
    assert cudart.used_bytes() - memory.device_used == 3 * session
    free, _ = server.model.device_memory()
    assert free < HEADROOM + session  # a fourth would have eaten into the server's headroom
    for state in states:
        state.close()
    server.model.close()
