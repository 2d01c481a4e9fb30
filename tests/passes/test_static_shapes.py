"""static_kv_attention + inline_functions + static_shapes on a traced step: every dimension fixed, standard ops
only; without the static attention body the cache slice stays data-dependent and the pass refuses."""

from __future__ import annotations

import pytest

from edgec.errors import BuildError
from edgec.export import cache_spec_for, export_step
from edgec.passes import run_passes
from edgec.passes.static_shapes import dynamic_values


@pytest.fixture
def step(tiny_hf_model):
    return export_step(tiny_hf_model, cache_spec_for(tiny_hf_model.config, 32))


def test_static_step_has_no_dynamic_dimension(step):
    counts, _ = run_passes(step, ["static_kv_attention", "inline_functions"])
    assert counts == {"static_kv_attention": 2, "inline_functions": 2}
    assert not step.functions and {node.domain for node in step.graph} == {""}
    assert "ai.edgec" not in step.opset_imports
    assert run_passes(step, ["static_shapes"], {"static_shapes": {"tokens": 8}})[0] == {
        "static_shapes": 4
    }  # input_ids, position_ids, logits_index, logits
    assert dynamic_values(step) == []
    assert [value.shape[1] for value in step.graph.inputs[:2]] == [8, 8]
    assert list(step.graph.outputs[0].shape) == [1, 8, step.graph.outputs[0].shape[2]]


def test_dynamic_attention_body_is_refused(step):
    run_passes(step, ["inline_functions"])  # the default body slices the cache to the filled length
    with pytest.raises(BuildError, match="dynamic dimensions"):
        run_passes(step, ["static_shapes"], {"static_shapes": {"tokens": 8}})
