"""The observing prompt chunk's attention a query head at a time (``_Attend.query_head_probs``, a Loop's
iteration) is the whole attention's (``_Attend.probs``) rows for that head, bit for bit: its own rows of q, its KV
head's keys and key positions (a sliding window masks differently per KV head once the heads keep different
slots) — read from a separate past or from the fp32 state itself up to the filled slots."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from edgec.kvcache.compressed_function import FORMAL, Heads, _Attend
from edgec.kvcache.onnx_body import Body

HEADS = Heads(query=6, kv=3, dim=8)
GROUP = HEADS.query // HEADS.kv
ROWS, ACTIVE, NEW, CAPACITY = 4, 9, 5, 12  # query rows, filled slots, new tokens, slots


def _session(from_state: bool) -> ort.InferenceSession:
    b = Body()
    group = b.i64([GROUP])
    rows_shape = b.i64([0, HEADS.kv, -1, HEADS.dim])
    if from_state:  # fp32 slots: the past is the state itself, sliced up to the filled slots
        old_k = b.op("Slice", FORMAL["k"], b.i64([0]), "active", b.i64([2]))
        attend = _Attend(old_k, "", "key_pos", rows_shape, group, "scale", "window", sliced_to="active")
    else:
        attend = _Attend("old_k", "", "key_pos", rows_shape, group, "scale", "window")
    rows = b.i64([ROWS])
    whole = b.op("Identity", attend.probs(b, "q", "positions", rows), name="whole")
    alone = [
        b.op("Identity", attend.query_head_probs(b, f"query{index}", HEADS, "q", "positions", rows))
        for index in range(HEADS.query)
    ]
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    inputs = [
        helper.make_tensor_value_info("q", f, [1, HEADS.query, ROWS, HEADS.dim]),
        helper.make_tensor_value_info("k", f, [1, HEADS.kv, NEW, HEADS.dim]),
        helper.make_tensor_value_info("old_k", f, [1, HEADS.kv, ACTIVE, HEADS.dim]),
        helper.make_tensor_value_info(FORMAL["k"], f, [1, HEADS.kv, CAPACITY, HEADS.dim]),
        helper.make_tensor_value_info("key_pos", i64, [1, HEADS.kv, ACTIVE + NEW]),
        helper.make_tensor_value_info("positions", i64, [1, ROWS]),
        helper.make_tensor_value_info("active", i64, [1]),
        helper.make_tensor_value_info("scale", f, []),
        helper.make_tensor_value_info("window", i64, []),
        *(helper.make_tensor_value_info(f"query{index}", i64, [1]) for index in range(HEADS.query)),  # iterations
    ]
    outputs = [helper.make_tensor_value_info(name, f, None) for name in (whole, *alone)]
    used = {name for node in b.nodes for name in node.input}
    graph = helper.make_graph(b.nodes, "observation", [i for i in inputs if i.name in used], outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("from_state", [False, True], ids=["past", "state"])
@pytest.mark.parametrize("window", [0, 6])
def test_each_query_head_alone_gives_its_rows_of_the_whole_attention(from_state, window):
    rng = np.random.default_rng(window + from_state)
    state = rng.standard_normal((1, HEADS.kv, CAPACITY, HEADS.dim)).astype(np.float32)
    # each KV head keeps different positions (evicted differently), one of them an empty slot
    slots = np.stack([rng.choice(20, ACTIVE, replace=False) for _ in range(HEADS.kv)])[None]
    slots[0, 1, 4] = -1
    new = np.broadcast_to(np.arange(20, 20 + NEW), (1, HEADS.kv, NEW))
    feed = {
        "q": rng.standard_normal((1, HEADS.query, ROWS, HEADS.dim)).astype(np.float32),
        "k": rng.standard_normal((1, HEADS.kv, NEW, HEADS.dim)).astype(np.float32),
        "old_k": state[:, :, :ACTIVE].copy(),
        FORMAL["k"]: state,
        "key_pos": np.concatenate([slots, new], axis=2).astype(np.int64),
        "positions": np.arange(21, 21 + ROWS, dtype=np.int64)[None],
        "active": np.array([ACTIVE], np.int64),
        "scale": np.array(0.3, np.float32),
        "window": np.array(window, np.int64),
    } | {f"query{index}": np.array([index], np.int64) for index in range(HEADS.query)}
    session = _session(from_state)
    whole, *alone = session.run(None, {i.name: feed[i.name] for i in session.get_inputs()})
    assert whole.shape == (1, HEADS.kv, GROUP * ROWS, ACTIVE + NEW)
    if window:  # the windows differ per KV head: the test would see keys read at another head's positions
        assert len({tuple((whole[0, h] == 0).ravel()) for h in range(HEADS.kv)}) == HEADS.kv
    for index, probs in enumerate(alone):
        kv_head, member = divmod(index, GROUP)
        np.testing.assert_array_equal(probs, whole[:, kv_head : kv_head + 1, member * ROWS : (member + 1) * ROWS])
