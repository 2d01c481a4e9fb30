"""The runtime asks for the provider the manifest names: when it is absent, one line naming the extra to install
(never a silent run on the CPU); when it leaves nodes to the CPU, a note says which."""

from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest

from edgec.errors import BundleError
from edgec.runtime import Model
from edgec.runtime.backend_ort import cpu_fallback_note


@pytest.mark.parametrize(
    "provider,extra",
    [("CANNExecutionProvider", "cann"), ("OpenVINOExecutionProvider", "openvino"), ("CUDAExecutionProvider", "cuda")],
)
def test_absent_provider_names_the_extra(tiny_bundle, tmp_path, provider, extra):
    bundle = shutil.copytree(tiny_bundle, tmp_path / "b.edgec")
    data = json.loads((bundle / "manifest.json").read_text())
    data["runtime"]["providers"] = [provider]
    (bundle / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BundleError) as error:
        Model.load(bundle)
    message = str(error.value)
    assert provider in message and f"pip install 'edgec[{extra}]'" in message and "\n" not in message


def _session(assignments):
    subgraphs = [
        SimpleNamespace(ep_name=ep, get_nodes=lambda ops=ops: [SimpleNamespace(op_type=op) for op in ops])
        for ep, ops in assignments
    ]
    return SimpleNamespace(get_provider_graph_assignment_info=lambda: subgraphs)


def test_nodes_left_to_the_cpu_are_named():
    session = _session(
        [("CANNExecutionProvider", ["MatMul"] * 9), ("CPUExecutionProvider", ["CumSum", "Shape", "Shape"])]
    )
    note = cpu_fallback_note(session, "CANNExecutionProvider", "model.onnx")
    assert note == "note: CANNExecutionProvider left 3 node(s) of model.onnx to the CPU (Shape ×2, CumSum ×1)"
    assert cpu_fallback_note(_session([("CANNExecutionProvider", ["MatMul"])]), "CANNExecutionProvider", "m") is None
    assert cpu_fallback_note(session, "CPUExecutionProvider", "m") is None  # asked for the CPU: nothing to say
    assert cpu_fallback_note(SimpleNamespace(), "CANNExecutionProvider", "m") is None  # an ORT too old to tell


def test_a_cpu_session_reports_nothing(tiny_bundle, caplog):
    with caplog.at_level(logging.WARNING, logger="edgec.runtime"):
        Model.load(tiny_bundle)
    assert not caplog.records


RECORD = "session.record_ep_graph_assignment_info"


def test_only_a_non_cpu_provider_s_session_records_where_each_node_ran(tiny_bundle, monkeypatch):
    """The record is what ``cpu_fallback_note`` reads, and it costs memory for the session's whole life: a CPU
    session does not keep it, one whose first provider is another does."""
    from edgec.runtime import backend_ort

    model = Model.load(tiny_bundle)
    with pytest.raises(RuntimeError, match="does not have configuration"):
        model._backend.graph.session.get_session_options().get_session_config_entry(RECORD)
    opened = []
    real = backend_ort.ort.InferenceSession

    def on_the_cpu(path, options, providers, provider_options):  # no other provider here: the CPU, options kept
        opened.append(options)
        return real(path, options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(backend_ort.ort, "InferenceSession", on_the_cpu)
    providers = ["CANNExecutionProvider", "CPUExecutionProvider"]
    with pytest.raises(BundleError, match="could not start"):
        backend_ort.OrtGraph(tiny_bundle / "model.onnx", model._backend.graph.spec, providers, 1, None, exact=True)
    assert opened[0].get_session_config_entry(RECORD) == "1"
