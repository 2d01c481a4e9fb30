"""The exact GGUF import (issue 16): a tiny Llama GGUF that mixes every block type edgec carries (tests/tiny_gguf.py)
is built at --weights int4; every linear layer must be the GGUF's own rows bit for bit as ONNX Runtime computes
with them, the logits at --accuracy-level 1 those of the fp32 bundle (the GGUF dequantized) within float rounding,
the weights no bigger than the GGUF's, and verify --compare must pass the fresh bundle and fail a corrupted one."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from edgec.kvcache.compression import Compression
from tests.gguf_exact import assert_weights_are_the_gguf_s
from tests.kvcache.helpers import op_types
from tests.tiny_gguf import HEADS, LAYERS, quantized, write_tiny_llama_gguf

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory, tiny_tokenizer) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_tokenizer)


@pytest.fixture(scope="module")
def built(tmp_path_factory, mixed_gguf) -> dict[str, Path]:
    """fp32, int4 at accuracy level 1 (fp32 activations), int4 at the default level (int8 activations split in two
    rows) and with plain int8 activations, from the same GGUF."""
    from edgec.build import BuildSettings, build

    root = tmp_path_factory.mktemp("bundles")
    for name, extra in VARIANTS.items():
        build(mixed_gguf, root / name, BuildSettings(context=128, prefill_chunk=32, **extra))
    return {name: root / name for name in VARIANTS}


VARIANTS = {
    "fp32": {},
    "int4-l1": {"weights": "int4", "accuracy_level": 1},
    "int4": {"weights": "int4"},  # int8 activations, split in two rows (the default for a GGUF's blocks)
    "int4-one-row": {"weights": "int4", "split_activations": False},
    "int4-kv": {"weights": "int4", "kv": Compression(capacity=40, sink=2, window=8, dtype="int8")},  # evicts
}


def test_the_memory_planner_counts_the_sessions_each_build_has(built, mixed_gguf):
    """A GGUF's split products get a prompt-chunk graph — a second session with its own weights — and the build's
    memory check counts it exactly where the bundle has one (edgec/plan.py)."""
    from edgec.build import BuildSettings, memory_settings, plan_build, splits_activations
    from edgec.load import inspect_source
    from edgec.plan import count_weight_copies

    source = inspect_source(mixed_gguf)
    copies = {}
    for name, extra in VARIANTS.items():
        settings = BuildSettings(context=128, prefill_chunk=32, **extra)
        plan = plan_build(settings, source["shape"], source["shape"].max_context, source["kind"])
        kv_dtype = plan.kv.dtype if plan.kv else "fp32"
        planned = memory_settings(plan, kv_dtype, splits_activations(plan, settings, source["kind"]))
        copies[name] = count_weight_copies(plan.target, planned)
        assert copies[name] == (2 if (built[name] / "prefill.onnx").exists() else 1), name
    assert copies["int4"] == 2 and copies["int4-one-row"] == 1  # both kinds are in the matrix


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_decoded_blocks_dequantize_as_the_gguf_library(type_name):
    """Codes, fp16 steps and minima and integer sub-scales read from the raw blocks rebuild every value exactly."""
    from edgec.ggufblocks import decode_rows

    raw = quantized(np.random.default_rng(1), type_name, 8, 512, 0.05)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    got = decode_rows(raw, type_name).dequantize()
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_weight_not_in_the_file_is_not_carried(mixed_gguf):
    from edgec.ggufblocks import GgufBlocks

    blocks = GgufBlocks(mixed_gguf)
    assert blocks.find(np.random.default_rng(0).normal(size=(256, 64)).astype(np.float32)) is None
    assert blocks.record()["carried_exactly"] == 0


@pytest.mark.parametrize("name", ["int4-l1", "int4", "int4-one-row"])
def test_every_linear_layer_is_the_gguf_s_bit_for_bit(built, mixed_gguf, name, tmp_path):
    weights = assert_weights_are_the_gguf_s(built[name], mixed_gguf, tmp_path)
    assert weights == LAYERS * 4 + 1  # qkv, o, gate|up, down per layer, and the tied lm_head
    blocks = json.loads((built[name] / "manifest.json").read_text())["build_settings"]["gguf_blocks"]
    assert blocks["carried_exactly"] == blocks["weights"] == weights


def test_level_1_logits_are_the_fp32_bundle_s(built):
    """fp32 activations on the GGUF's exact weights: only summation order differs from the fp32 bundle."""
    from edgec.runtime import Model

    ids = np.random.default_rng(5).integers(0, 384, 60).tolist()
    reference, exact = Model.load(built["fp32"]), Model.load(built["int4-l1"])
    assert np.abs(reference.logprobs(ids) - exact.logprobs(ids)).max() < 1e-3
    assert np.abs(reference.next_token_logits(ids) - exact.next_token_logits(ids)).max() < 1e-3


def test_split_activations_keep_the_fp32_bundle_s_logits(built):
    """The default for a GGUF's blocks: each int8 activation as its int8 rounding plus the rest, so the kernel's own
    rounding touches only the rest. Far closer to fp32 than one row of int8 activations, on every product."""
    import onnx

    from edgec.runtime import Model

    settings = {name: json.loads((built[name] / "manifest.json").read_text())["build_settings"] for name in built}
    assert settings["int4"]["split_activations"] and not settings["int4-one-row"]["split_activations"]
    assert not settings["int4-l1"]["split_activations"]  # fp32 activations have nothing to split
    graph = onnx.load(str(built["int4"] / "model.onnx"), load_external_data=False).graph
    products = [node for node in graph.node if node.op_type == "MatMulNBits"]
    assert products and all(dict((a.name, a.i) for a in n.attribute)["accuracy_level"] == 4 for n in products)
    assert sum(node.op_type == "Concat" for node in graph.node) >= len(products)  # every product's two rows
    ids = np.random.default_rng(5).integers(0, 384, 60).tolist()
    reference = Model.load(built["fp32"]).logprobs(ids)

    def decoded(bundle: Path) -> np.ndarray:  # one token per step: the decode graph, where the split runs
        logits = np.concatenate([piece for _, piece in Model.load(bundle).iter_logits(ids, prompt_tokens=1)])
        shifted = logits[:-1] - logits[:-1].max(-1, keepdims=True)
        log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
        return log_softmax[np.arange(len(ids) - 1), ids[1:]]

    split = np.abs(decoded(built["int4"]) - reference).max()
    one_row = np.abs(decoded(built["int4-one-row"]) - reference).max()
    print(f"max |Δ logprob| vs fp32: split {split:.2e}, one row {one_row:.2e}")
    assert split < 1e-2 and split * 20 < one_row, (split, one_row)


def test_prompt_chunks_run_the_split_products_at_fp32_activations(built):
    """A split bundle carries prefill.onnx over the same weights file: every split product fed x itself at
    accuracy level 1 — the exact product the split approximates — so a prompt's logits are the level-1 bundle's.
    Bundles without split products carry no second graph."""
    import onnx

    from edgec.runtime import Model

    manifests = {name: json.loads((built[name] / "manifest.json").read_text()) for name in built}
    assert manifests["int4"]["model"]["prefill_file"] == "prefill.onnx"
    assert "prefill.onnx" in manifests["int4"]["files"]
    assert all("prefill_file" not in manifests[name]["model"] for name in ("fp32", "int4-l1", "int4-one-row"))
    graph = onnx.load(str(built["int4"] / "prefill.onnx"), load_external_data=False).graph
    levels = [
        dict((a.name, a.i) for a in n.attribute)["accuracy_level"] for n in graph.node if n.op_type == "MatMulNBits"
    ]
    assert levels and set(levels) == {1}
    assert not any(node.op_type == "Round" for node in graph.node)  # no split rows left
    # the 8-bit lm_head runs as its two 4-bit nibble products (ONNX Runtime's 8-bit fp32 kernel is slow)
    assert not any(
        dict((a.name, a.i) for a in n.attribute)["bits"] == 8 for n in graph.node if n.op_type == "MatMulNBits"
    )
    # the weights are model.onnx's own (never copied): what prefill.onnx adds are a few small constants
    decode_names = {
        t.name for t in onnx.load(str(built["int4"] / "model.onnx"), load_external_data=False).graph.initializer
    }
    added = [t for t in graph.initializer if t.name not in decode_names]
    assert all(not t.external_data and len(t.raw_data or b"") + 8 * len(t.int64_data) <= 64 for t in added), [
        t.name for t in added
    ]
    assert not any(
        entry.value != "model.onnx.data"
        for t in graph.initializer
        for entry in t.external_data
        if entry.key == "location"
    )
    ids = np.random.default_rng(6).integers(0, 384, 70).tolist()
    split, exact = Model.load(built["int4"], check_hashes=True), Model.load(built["int4-l1"])
    assert np.abs(split.logprobs(ids) - exact.logprobs(ids)).max() < 1e-4
    # a one-token step still runs the split graph: near level 1, not equal to it
    steps = [list(m.iter_logits(ids, prompt_tokens=len(ids) - 1))[-1][1] for m in (split, exact)]
    assert 0 < np.abs(steps[0] - steps[1]).max() < 1e-2


def _stored_bytes(bundle: Path) -> dict[str, int]:
    """Bytes of each initializer model.onnx.data holds."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    lengths = {}
    for tensor in model.graph.initializer:
        location = {entry.key: entry.value for entry in tensor.external_data}
        if "length" in location:
            lengths[tensor.name] = int(location["length"])
    return lengths


def test_weights_are_no_bigger_than_the_gguf_s(built, mixed_gguf):
    """The GGUF's numbers at their own width (fp16 steps and minima, small-integer sub-scales); what the graph
    adds of its own (RoPE tables, sized by the context) is not a weight."""
    tensor_bytes = sum(int(tensor.n_bytes) for tensor in gguf.GGUFReader(str(mixed_gguf)).tensors)
    for name in ("int4-l1", "int4", "int4-one-row"):
        stored = _stored_bytes(built[name])
        assert sum(stored.values()) == (built[name] / "model.onnx.data").stat().st_size
        weights = sum(size for tensor, size in stored.items() if not tensor.startswith("rope"))
        assert weights <= 1.02 * tensor_bytes, (name, weights / tensor_bytes)


def _corrupt_first_input_block(bundle: Path) -> str:
    """Invert the codes of the first block of 32 inputs in every output row of the first carried 4-bit weight in
    model.onnx.data (the manifest is then re-hashed: the bundle is self-consistent, only its numbers are wrong);
    returns the tensor's name. One row's block alone changed the validation prompts' logits by less than the
    tolerance on some tokenizer trainings (it is only head 0's query there)."""
    import onnx

    from edgec.bundle import write_manifest

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    for tensor in model.graph.initializer:
        if tensor.name.endswith(".codes") and tensor.data_type == onnx.TensorProto.UINT8 and tensor.dims[-1] == 16:
            offset = int(next(entry.value for entry in tensor.external_data if entry.key == "offset"))
            break
    else:
        raise AssertionError("no 4-bit codes in the bundle")
    data = np.fromfile(bundle / "model.onnx.data", dtype=np.uint8)
    rows, blocks, width = tensor.dims  # [N, blocks, 16 bytes]
    codes = data[offset : offset + rows * blocks * width].reshape(rows, blocks * width)
    codes[:, :width] ^= 0xFF  # each row's first block: every code q becomes 15 - q
    data.tofile(bundle / "model.onnx.data")
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest.pop("files")
    write_manifest(bundle, manifest)
    return tensor.name


@pytest.mark.parametrize("name", ["int4-l1", "int4"])
def test_verify_compare_passes_a_fresh_bundle_and_fails_one_corrupted_block(built, name, tmp_path):
    from edgec.verify import verify

    checks = verify(built[name], compare=True)
    assert not [check for check in checks if check.status == "fail"], [c.line() for c in checks]
    assert any(check.status == "info" and "source model" in check.name for check in checks)
    broken = shutil.copytree(built[name], tmp_path / "broken")
    _corrupt_first_input_block(broken)
    assert not [check for check in verify(broken) if check.status == "fail"]  # the hashes cannot see it
    failed = [check.name for check in verify(broken, compare=True) if check.status == "fail"]
    assert any(check.startswith("reference logits") for check in failed), failed


def _decoded_logprobs(model, ids: list[int], prompt_tokens: int) -> np.ndarray:
    logits = np.concatenate([piece for _, piece in model.iter_logits(ids, prompt_tokens=prompt_tokens)])
    shifted = logits[:-1] - logits[:-1].max(-1, keepdims=True)
    log_softmax = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return log_softmax[np.arange(len(ids) - 1), ids[1:]]


def _with_two_branch_body(bundle: Path, tmp_path: Path) -> Path:
    """A copy of a split bundle whose model.onnx holds the op's two-branch body (decode and general, as built
    before the split): what the one-branch graphs must answer like."""
    import onnx

    from edgec.kvcache import compressed_function as cf

    manifest = json.loads((bundle / "manifest.json").read_text())
    two_branch = tmp_path / "two-branch"
    shutil.copytree(bundle, two_branch)
    model = onnx.load(str(two_branch / "model.onnx"), load_external_data=False)
    opset = next(entry.version for entry in model.opset_import if entry.domain == "")
    layer = manifest["cache"]["layers"][0]
    heads = cf.Heads(HEADS, layer["num_kv_heads"], layer["head_dim"])
    full = cf.make_function(Compression.from_json(manifest["cache"]["compression"]), opset, heads, fused_attention=True)
    assert any(node.op_type == "If" for node in full.node)
    (index,) = [i for i, f in enumerate(model.functions) if f.name == cf.OP_TYPE]
    model.functions[index].CopyFrom(full)
    onnx.save(model, str(two_branch / "model.onnx"))
    manifest["files"]["model.onnx"]["size"] = (two_branch / "model.onnx").stat().st_size
    (two_branch / "manifest.json").write_text(json.dumps(manifest))
    return two_branch


def test_compressed_cache_decodes_on_its_branch_alone(built, tmp_path):
    """With a prefill graph, each graph holds one branch of the compressed op: model.onnx the one-token decode
    branch (no If per layer), prefill.onnx the general one. The answers are those of the two-branch graph
    (bit for bit in decode; the products are untouched: the tests above hold them to level 1), and model.onnx
    refuses a multi-token step rather than compute something else."""
    import onnx

    from edgec.kvcache import compressed_function as cf
    from edgec.runtime import Model
    from edgec.runtime.backend_ort import OrtCacheState
    from edgec.verify import compare_runtimes

    bundle = built["int4-kv"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["prefill_file"] == "prefill.onnx"
    bodies = {}
    for name in ("model.onnx", "prefill.onnx"):
        model = onnx.load(str(bundle / name), load_external_data=False)
        (bodies[name],) = [f for f in model.functions if f.name == cf.OP_TYPE]
    assert not any(node.op_type == "If" for node in bodies["model.onnx"].node)
    assert "TopK" not in op_types(bodies["model.onnx"].node)  # the general branch's pairing
    assert "TopK" in op_types(bodies["prefill.onnx"].node)
    # the same bundle with the two-branch body in model.onnx (as built before): the answers must not move
    two_branch = _with_two_branch_body(bundle, tmp_path)
    ids = np.random.default_rng(7).integers(0, 384, 60).tolist()
    one, two = Model.load(bundle), Model.load(two_branch)
    assert np.array_equal(_decoded_logprobs(one, ids, 1), _decoded_logprobs(two, ids, 1))  # every step decodes
    assert np.abs(_decoded_logprobs(one, ids, 40) - _decoded_logprobs(two, ids, 40)).max() < 1e-4
    # verify's cross-runtime check feeds whole prompts: to the prefill graph (model.onnx would refuse them)
    cpu = ["CPUExecutionProvider", "CPUExecutionProvider"]
    check = compare_runtimes(bundle, json.loads((bundle / "manifest.json").read_text()), providers=cpu)
    assert check.status == "pass", check.detail
    state = OrtCacheState(one._backend.graph, one._backend.vocab_size)  # model.onnx alone, no prefill graph
    state.reset()
    with pytest.raises(Exception, match="Non-zero status code"):
        state.run(np.array(ids[:3], np.int64), 0, last_only=True)


@pytest.mark.slow
def test_mixed_cache_decodes_on_its_branch_alone(mixed_gguf, tmp_path):
    """The one-branch split (decode branch in model.onnx, general in prefill.onnx) also holds for the mixed-precision
    body (two slot pools, --kv-mixed): same answers as the two-branch graph, bit for bit in decode."""
    import onnx

    from edgec.build import BuildSettings, build
    from edgec.kvcache import compressed_function as cf
    from edgec.runtime import Model

    bundle = tmp_path / "mixed"
    kv = Compression(capacity=40, sink=2, window=8, dtype="int4", mixed="int8")  # evicts, demotes
    build(mixed_gguf, bundle, BuildSettings(context=128, prefill_chunk=32, weights="int4", kv=kv))
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert manifest["model"]["prefill_file"] == "prefill.onnx"
    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    (body,) = [f for f in model.functions if f.name == cf.OP_TYPE]
    assert not any(node.op_type == "If" for node in body.node)
    two_branch = _with_two_branch_body(bundle, tmp_path)
    ids = np.random.default_rng(7).integers(0, 384, 60).tolist()
    one, two = Model.load(bundle), Model.load(two_branch)
    assert np.array_equal(_decoded_logprobs(one, ids, 1), _decoded_logprobs(two, ids, 1))
    assert np.abs(_decoded_logprobs(one, ids, 40) - _decoded_logprobs(two, ids, 40)).max() < 1e-4
