"""Progress inside the long stages of a build: a GGUF's tensors as they are read, the trace layer by layer, and the
TensorRT-RTX builder's phases (its IProgressMonitor), each reported through the build's progress callback."""

from __future__ import annotations

import pytest

from edgec.build import BuildSettings, build
from edgec.shape import model_shape
from tests.tiny_gguf import write_tiny_llama_gguf


def recorded_build(source, out, **settings) -> list[tuple]:
    calls: list[tuple] = []
    build(source, out, BuildSettings(context=64, **settings), progress=lambda *args: calls.append(args))
    return calls


def steps_of(calls: list[tuple], stage: str) -> list[tuple[int, int]]:
    return [(done, total) for name, *rest in calls if name == stage and rest for done, total in [rest]]


def test_a_gguf_build_reports_its_tensors_and_layers(tmp_path, tiny_tokenizer):
    gguf = write_tiny_llama_gguf(tmp_path / "tiny.gguf", tiny_tokenizer)
    calls = recorded_build(gguf, tmp_path / "b.edgec")
    tensors = steps_of(calls, "gguf tensors")
    assert tensors and tensors[-1][0] == tensors[-1][1] > 1
    assert [done for done, _ in tensors] == list(range(1, tensors[-1][1] + 1))  # each tensor once, in order
    count = model_shape(gguf).layers
    assert steps_of(calls, "trace layers")[-count:] == [(done, count) for done in range(1, count + 1)]
    stages = [name for name, *rest in calls if not rest]
    # sub-steps come inside their stage: tensors during load, layers during export
    first = {name: i for i, (name, *_) in reversed(list(enumerate(calls)))}
    assert first["load"] < first["gguf tensors"] < first["export"] < first["trace layers"] < first["to onnx"]
    assert stages == ["load", "calibrate", "export", "save", "validate", "engine", "bundle"]


def test_the_engine_build_reports_the_builders_phases(tiny_llama, tmp_path):
    pytest.importorskip("tensorrt_rtx")
    calls = recorded_build(tiny_llama, tmp_path / "t.edgec", target="rtx3060")
    engine = [call for call in calls if call[0].startswith("tensorrt-rtx ") and len(call) == 3]
    assert engine, calls
    assert all(0 <= done <= total for _, done, total in engine)
    assert engine[-1][1] == engine[-1][2], engine  # the last phase reported to its end
    assert calls.index(("engine",)) < calls.index(engine[0]) < calls.index(("bundle",))
