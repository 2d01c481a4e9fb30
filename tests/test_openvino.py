"""openvino-ipc: the graph OpenVINO takes (no opset-23 function ops, KVAttention as its portable function), same
greedy tokens as the cpu bundle. onnxruntime-openvino replaces the `onnxruntime` module, so it lives in
.venv-openvino (bash scripts/setup-openvino.sh); where that exists the bundle is run there for real."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import onnx
import pytest

from edgec.build import BuildSettings, build
from edgec.runtime import Model
from tests.conftest import manifest

OPENVINO_PYTHON = Path(__file__).resolve().parents[1] / ".venv-openvino" / "bin" / "python"
PROMPT = "def fibonacci(n):\n    return"


@pytest.fixture(scope="module")
def openvino_bundle(tmp_path_factory, tiny_llama):
    out = tmp_path_factory.mktemp("openvino") / "tiny.openvino-ipc.edgec"
    build(tiny_llama, out, BuildSettings(target="openvino-ipc", context=128, prefill_chunk=16))
    return out


def test_graph_is_what_openvino_takes(openvino_bundle):
    data = manifest(openvino_bundle)
    assert data["runtime"]["providers"] == ["OpenVINOExecutionProvider"]
    assert data["runtime"]["provider_options"]["OpenVINOExecutionProvider"]["precision"] == "ACCURACY"
    ops = {node.op_type for node in onnx.load(str(openvino_bundle / "model.onnx"), load_external_data=False).graph.node}
    assert not ops & {"RMSNormalization", "RotaryEmbedding", "GroupQueryAttention"}


def test_same_greedy_tokens_on_the_cpu_provider(openvino_bundle, tiny_bundle):
    want = list(Model.load(tiny_bundle).generate_ids(PROMPT, max_new_tokens=24))
    assert (
        list(Model.load(openvino_bundle, providers=["CPUExecutionProvider"]).generate_ids(PROMPT, max_new_tokens=24))
        == want
    )


@pytest.mark.skipif(not OPENVINO_PYTHON.exists(), reason="no .venv-openvino (bash scripts/setup-openvino.sh)")
def test_same_greedy_tokens_on_openvino(openvino_bundle, tiny_bundle):
    script = (
        "import json, sys; from edgec.runtime import Model; m = Model.load(sys.argv[1]); "
        "print(json.dumps([m._step.providers, list(m.generate_ids(sys.argv[2], max_new_tokens=24))]))"
    )
    done = subprocess.run(
        [str(OPENVINO_PYTHON), "-c", script, str(openvino_bundle), PROMPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    providers, tokens = json.loads(done.stdout.strip().splitlines()[-1])
    assert providers[0] == "OpenVINOExecutionProvider"
    assert "left" not in done.stderr  # OpenVINO took every node: no note about nodes left to the CPU
    assert tokens == list(Model.load(tiny_bundle).generate_ids(PROMPT, max_new_tokens=24))
