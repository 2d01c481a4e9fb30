"""A bundle from an untrusted source is closed: every path the manifest or the graph names is a listed regular file
inside the bundle, every manifest number is bounded before anything is allocated, and provider options come from
an allow-list. Each case is a hostile bundle an attacker could hand over (hashes recomputed, as they would), and
each must give BundleError (API), exit 2 with one error line (CLI run/inspect) or a failed check (verify), and
never a read of the file outside the bundle."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from click.testing import CliRunner

from edgec.cli import main
from edgec.errors import BundleError
from edgec.manifest_schema import manifest_errors
from edgec.runtime import Model
from edgec.verify import verify
from tests.hostile import (
    FileWatch,
    copy_bundle,
    edit_manifest,
    fifo_in_place_of,
    file_entry,
    raised_within,
    read_manifest,
    rehash,
)


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def assert_one_error_line(result, *needles: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.fixture
def bundle(tiny_bundle, tmp_path):
    return copy_bundle(tiny_bundle, tmp_path)


@pytest.fixture
def outside(tiny_bundle, tmp_path):
    """Copies of the bundle's files outside it: what a hostile manifest points at."""
    folder = tmp_path / "outside"
    folder.mkdir()
    for name in ("tokenizer.json", "model.onnx", "model.onnx.data"):
        shutil.copy(tiny_bundle / name, folder / name)
    return folder


def refused_everywhere(bundle, outside, *needles: str, compare: bool = False) -> None:
    """Model.load, verify (``compare``: running the graph too), run and inspect all refuse the bundle, and nothing
    outside it is read."""
    watch = FileWatch(outside)
    try:
        with pytest.raises(BundleError) as raised:
            Model.load(bundle, check_hashes=True)
        for needle in needles:
            assert needle in str(raised.value), raised.value
        checks = verify(bundle, compare=compare)
        assert any(check.status == "fail" for check in checks), "verify passed a hostile bundle"
        assert_one_error_line(invoke("run", bundle, "hi", "-n", "1"), *needles)
        inspected = invoke("inspect", bundle)
        assert inspected.exit_code in (0, 2) and "Traceback" not in inspected.output
        assert watch.events() == [], "a file outside the bundle was read"
    finally:
        watch.close()


def test_the_watch_sees_reads(outside):
    """The read watch is real: reading a file beside it is seen (so the empty lists below mean something)."""
    watch = FileWatch(outside)
    (outside / "tokenizer.json").read_bytes()
    assert str(outside / "tokenizer.json") in watch.events()
    watch.close()


@pytest.mark.parametrize(
    "section,key,value",
    [
        ("tokenizer", "file", "../outside/tokenizer.json"),
        ("tokenizer", "file", "{outside}/tokenizer.json"),
        ("tokenizer", "file", "..\\outside\\tokenizer.json"),
        ("tokenizer", "file", "sub/../../outside/tokenizer.json"),
        ("model", "file", "../outside/model.onnx"),
        ("model", "decode_file", "{outside}/model.onnx"),
        ("runtime", "engine", "../outside/model.onnx"),
    ],
)
def test_a_path_outside_the_bundle_is_refused(bundle, outside, section, key, value):
    """Issue 15.1: the manifest names a file outside the bundle, not listed in ``files``."""

    def change(manifest):
        manifest[section][key] = value.format(outside=outside)
        if key == "decode_file":
            manifest["model"]["static_tokens"] = 16

    edit_manifest(bundle, change)
    refused_everywhere(bundle, outside)


def test_a_listed_outside_path_is_refused(bundle, outside):
    """The attacker also lists the outside file, with its right size and sha256."""

    def change(manifest):
        manifest["files"]["../outside/tokenizer.json"] = file_entry(outside / "tokenizer.json")
        manifest["tokenizer"]["file"] = "../outside/tokenizer.json"

    edit_manifest(bundle, change)
    refused_everywhere(bundle, outside, "unsafe path")


def test_a_symbolic_link_is_refused(bundle, outside):
    """A listed name that is a link to a file outside (size and sha256 those of the target)."""
    (bundle / "tokenizer.json").unlink()
    os.symlink(outside / "tokenizer.json", bundle / "tokenizer.json")
    refused_everywhere(bundle, outside, "symbolic link")


@pytest.fixture(scope="module")
def trusted_key(tmp_path_factory):
    from edgec.signing import generate_keypair

    return generate_keypair(tmp_path_factory.mktemp("keys") / "release")[1]


@pytest.mark.parametrize("name", ["manifest.json", "signature.json"])
def test_a_named_pipe_is_refused_without_waiting(bundle, trusted_key, name):
    """A bundle folder copied from somewhere holds a named pipe as its manifest (or signature): refused at once
    as not a regular file, where a plain open would wait for a writer forever."""
    pipe = fifo_in_place_of(bundle / name)
    error = raised_within(30, lambda: Model.load(bundle, trust=trusted_key), pipe)
    assert isinstance(error, BundleError) and "is not a regular file" in str(error), error
    results = []
    assert (
        raised_within(30, lambda: results.append(invoke("run", bundle, "hi", "-n", "1", "--trust", trusted_key)), pipe)
        is None
    )
    assert_one_error_line(results[0], "not a regular file")


def test_a_linked_folder_is_refused(bundle, outside):
    os.symlink(outside, bundle / "sub")

    def change(manifest):
        manifest["files"]["sub/tokenizer.json"] = file_entry(outside / "tokenizer.json")
        manifest["tokenizer"]["file"] = "sub/tokenizer.json"

    edit_manifest(bundle, change)
    refused_everywhere(bundle, outside, "symbolic link")


def _relocate_external_data(bundle, location: str, offset: str | None = None) -> None:
    """Point the graph's first external tensor at ``location`` and re-hash the graph (an attacker's edit)."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.external_data)
    for entry in tensor.external_data:
        if entry.key == "location":
            entry.value = location
        if entry.key == "offset" and offset is not None:
            entry.value = offset
    onnx.save(model, str(bundle / "model.onnx"))
    rehash(bundle, "model.onnx")


@pytest.mark.parametrize(
    "location,offset,needle",
    [
        ("../outside/model.onnx.data", None, "'..' part"),
        ("{outside}/model.onnx.data", None, "an absolute path"),
        ("*/_ORT_MEM_ADDR_/*", None, "characters other than"),
        ("unlisted.data", None, "does not list"),
        ("model.onnx.data", str(10**9), "which has"),
    ],
    ids=["parent", "absolute", "memory-address", "unlisted", "past-the-end"],
)
def test_external_data_outside_the_bundle_is_refused(bundle, outside, location, offset, needle):
    """Issue 15.2: edgec reads the graph's external-data locations itself, whatever ONNX Runtime release is here."""
    shutil.copy(bundle / "model.onnx.data", bundle / "unlisted.data")
    _relocate_external_data(bundle, location.format(outside=outside), offset)
    refused_everywhere(bundle, outside, "stores its data", needle)


def _outside_tensor(onnx, name: str):
    """A float tensor whose 16 bytes an attacker says lie outside the bundle."""
    tensor = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=[4])
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "../outside/model.onnx.data"), ("offset", "0"), ("length", "16")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def _hide_sparse_initializer(onnx, model) -> None:
    indices = onnx.helper.make_tensor("hidden_indices", onnx.TensorProto.INT64, [4], [0, 1, 2, 3])
    model.graph.sparse_initializer.append(onnx.helper.make_sparse_tensor(_outside_tensor(onnx, "hidden"), indices, [8]))


def _hide_sparse_attribute(onnx, model) -> None:
    indices = onnx.helper.make_tensor("hidden_indices", onnx.TensorProto.INT64, [4], [0, 1, 2, 3])
    sparse = onnx.helper.make_sparse_tensor(_outside_tensor(onnx, "hidden"), indices, [8])
    model.graph.node.append(onnx.helper.make_node("Constant", [], ["hidden_out"], sparse_value=sparse))


def _hide_in_a_branch(onnx, model) -> None:
    """A Constant's tensor in an If's branch, two levels down."""

    def branch(name: str, inner=None):
        nodes = [onnx.helper.make_node("Constant", [], [f"{name}_out"], value=_outside_tensor(onnx, name))]
        if inner is not None:
            nodes.append(inner)
        out = onnx.helper.make_tensor_value_info(f"{name}_out", onnx.TensorProto.FLOAT, [4])
        return onnx.helper.make_graph(nodes, name, [], [out])

    flag = onnx.helper.make_tensor("hidden_flag", onnx.TensorProto.BOOL, [], [True])
    model.graph.initializer.append(flag)
    deep = onnx.helper.make_node("If", ["hidden_flag"], ["deep_out"], then_branch=branch("a"), else_branch=branch("b"))
    node = onnx.helper.make_node(
        "If", ["hidden_flag"], ["hidden_out"], then_branch=branch("c", deep), else_branch=branch("d")
    )
    model.graph.node.append(node)


def _hide_in_a_function(onnx, model) -> None:
    constant = onnx.helper.make_node("Constant", [], ["y"], value=_outside_tensor(onnx, "hidden"))
    function = onnx.helper.make_function("hidden.domain", "Hidden", [], ["y"], [constant], model.opset_import)
    model.functions.append(function)


def _hide_in_training_info(onnx, model) -> None:
    graph = onnx.helper.make_graph([], "initialization", [], [], initializer=[_outside_tensor(onnx, "hidden")])
    model.training_info.add().initialization.CopyFrom(graph)


@pytest.mark.parametrize(
    "hide",
    [_hide_sparse_initializer, _hide_sparse_attribute, _hide_in_a_branch, _hide_in_a_function, _hide_in_training_info],
    ids=["sparse-initializer", "sparse-attribute", "nested-branch", "function", "training-info"],
)
def test_external_data_anywhere_in_the_graph_is_refused(bundle, outside, hide):
    """onnx_scan reads every tensor of the file, not only the main graph's initializers: one that names a file
    outside the bundle is refused wherever it hides (ONNX Runtime would follow some of these paths itself)."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    hide(onnx, model)
    onnx.save(model, str(bundle / "model.onnx"))
    rehash(bundle, "model.onnx")
    refused_everywhere(bundle, outside, "stores its data", "'..' part")


def test_an_unknown_domain_op_is_one_line(bundle, outside):
    """Issue 15.8: an op of a domain no runtime has; ONNX Runtime's traceback never reaches the user."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    model.graph.node[0].domain = "evil.domain"
    model.opset_import.append(onnx.helper.make_opsetid("evil.domain", 1))
    onnx.save(model, str(bundle / "model.onnx"))
    rehash(bundle, "model.onnx")
    refused_everywhere(bundle, outside, "unknown domain 'evil.domain'")


def test_an_ep_context_node_is_refused(bundle, outside):
    """EPContext makes ONNX Runtime load a cache file by name."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    node = onnx.helper.make_node(
        "EPContext", [], ["ctx"], domain="com.microsoft", ep_cache_context=str(outside / "x"), embed_mode=0
    )
    model.graph.node.append(node)
    onnx.save(model, str(bundle / "model.onnx"))
    rehash(bundle, "model.onnx")
    refused_everywhere(bundle, outside, "'EPContext' node")


def test_a_graph_onnx_runtime_refuses_is_one_line(bundle, outside):
    """A graph that passes edgec's reading but not ONNX Runtime's (an op that does not exist)."""
    import onnx

    model = onnx.load(str(bundle / "model.onnx"), load_external_data=False)
    model.graph.node[0].op_type = "NoSuchOperator"
    onnx.save(model, str(bundle / "model.onnx"))
    rehash(bundle, "model.onnx")
    refused_everywhere(bundle, outside, "ONNX Runtime cannot load", compare=True)


def test_a_garbage_graph_is_one_line(bundle, outside):
    (bundle / "model.onnx").write_bytes(b"\x0a\xff\xff\xff\xff\x0f not a protobuf")
    rehash(bundle, "model.onnx")
    refused_everywhere(bundle, outside, "not a readable ONNX model")


@pytest.mark.parametrize(
    "runtime,needle",
    [
        ({"provider_options": {"CPUExecutionProvider": {"bogus": "1"}}}, "'bogus'"),
        ({"providers": ["AzureExecutionProvider"]}, "'AzureExecutionProvider'"),
        ({"provider_options": {"OpenVINOExecutionProvider": {"cache_dir": "/tmp/x"}}}, "'cache_dir'"),
        ({"provider_options": {"OpenVINOExecutionProvider": {"load_config": "/etc/x.json"}}}, "'load_config'"),
        ({"provider_options": {"CUDAExecutionProvider": {"user_compute_stream": "140000"}}}, "'user_compute_stream'"),
        ({"provider_options": {"CANNExecutionProvider": {"precision_mode": "../../x"}}}, "not an allowed value"),
        ({"provider_options": {"AzureExecutionProvider": {}}}, "unknown provider"),
        ({"provider_options": {"CPUExecutionProvider": "x"}}, "must be an object"),
    ],
    ids=["bogus-option", "azure", "cache-dir", "load-config", "pointer", "bad-value", "azure-options", "not-object"],
)
def test_provider_options_come_from_an_allow_list(bundle, outside, runtime, needle):
    """Issue 15.4: a bundle cannot pass ONNX Runtime an option it has not been vetted for."""
    edit_manifest(bundle, lambda manifest: manifest["runtime"].update(runtime))
    refused_everywhere(bundle, outside, needle)


def test_every_target_provider_option_is_allowed(tiny_bundle):
    """The allow-list admits what edgec's own targets write (a target with a new option must extend it)."""
    from edgec.targets import ORT_PROVIDERS, available_targets, load_target

    for name in available_targets():
        target = load_target(name)
        if not target.provider_options:
            continue
        manifest = read_manifest(tiny_bundle)
        provider = ORT_PROVIDERS[target.runtime]
        manifest["runtime"] |= {"providers": [provider], "provider_options": {provider: target.provider_options}}
        assert manifest_errors(manifest) == [], name


@pytest.mark.parametrize(
    "path,value,needle",
    [
        (("model", "vocab_size"), -1, "outside [1, 4,194,304]"),
        (("model", "vocab_size"), 2**40, "vocab_size"),
        (("model", "context"), 10**30, "context"),
        (("build_settings", "prefill_chunk"), 0, "prefill_chunk"),
        (("cache", "layers", 0, "capacity"), 10**15, "capacity"),
        (("cache", "layers", 0, "num_kv_heads"), 0, "num_kv_heads"),
        (("cache", "layers", 0, "head_dim"), -16, "head_dim"),
        (
            ("cache", "layers"),
            [
                dict(
                    layer=0,
                    num_kv_heads=1024,
                    head_dim=16,
                    capacity=2**24,
                    window=0,
                    compressed=False,
                    state=["k", "v"],
                )
            ],
            "cache state",
        ),
        (("cache", "layers", 0, "state"), ["k", "v", "score"], "state must be [k, v] or [k, v, pos]"),
        (("cache", "layers", 0, "state"), ["k", "v", "rm -rf"], "must be one of"),
        (("runtime", "prefill_chunk"), 0, "runtime.prefill_chunk"),
        (("runtime", "prefill_chunk"), 10**6, "runtime.prefill_chunk"),
        (("runtime", "protect"), "numbers;names", "runtime.protect"),
        (("cache", "layers", 0, "num_kv_heads"), 3, "the manifest's cache says"),
        (("cache", "layers", 0, "layer"), 1, "once each"),
        (("cache", "layers", 0, "extra"), 1, "unknown key"),
        (("cache", "dtype"), "bfloat13", "must be one of"),
        (("model", "num_layers"), 3, "model.num_layers says 3"),
        (("cache", "layers"), [], "its length"),
        (("model", "vocab_size"), 100, "logits"),
        (("generation", "eos_token_ids"), [2**40], "eos_token_ids[0]"),
        (("generation", "eos_token_ids"), [{"a": 1}], "must be int"),
        (("validation", "prompts"), 10**9, "prompts"),
        (("target", "usable_fraction"), 3.5, "usable_fraction"),
        (("files", "model.onnx", "size"), -1, "size"),
        (("tokenizer", "chat_format", "user"), ["only one"], "its length"),
        (("build_settings", "protect"), ["numbers"], "protect"),
    ],
)
def test_manifest_numbers_are_bounded_before_anything_is_allocated(bundle, outside, path, value, needle):
    """Issue 15.8: out-of-range, negative and huge numbers (and values that cannot go together) are one line."""

    def change(manifest):
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    edit_manifest(bundle, change)
    refused_everywhere(bundle, outside, needle)


@pytest.mark.parametrize(
    "text,needle",
    [
        ('{"format_version": 1, "a": 1e999}', "out of range"),
        ('{"format_version": 1, "a": NaN}', "not a JSON number"),
        ('{"format_version": 1, "a": ' + "9" * 5000 + "}", "not valid JSON"),
        ('{"format_version": 1, "format_version": 1}', "appears twice"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
        ("[1, 2]", "no format_version"),
        ('{"format_version": true}', "no format_version"),
        ("\xff\xfe", "not valid JSON"),
    ],
    ids=["inf", "nan", "huge-int", "duplicate-key", "deep", "list", "bool-version", "not-utf8"],
)
def test_malformed_manifest_json_is_one_line(bundle, outside, text, needle):
    (bundle / "manifest.json").write_bytes(text.encode("latin-1") if text.startswith("\xff") else text.encode())
    refused_everywhere(bundle, outside, needle)


def test_an_oversized_manifest_is_refused_unread(bundle, outside):
    with open(bundle / "manifest.json", "ab") as handle:
        handle.truncate(64 * 2**20)
    refused_everywhere(bundle, outside, "larger than")


def test_a_catastrophic_tokenizer_regex_is_one_line(bundle, outside):
    """Issue 15.8: a regex that backtracks past Oniguruma's limit makes the tokenizers library panic (a
    BaseException); the runtime turns it into BundleError, the CLI into one line."""
    tokenizer = json.loads((bundle / "tokenizer.json").read_text())
    tokenizer["pre_tokenizer"] = {
        "type": "Split",
        "pattern": {"Regex": "(a|aa)+$"},
        "behavior": "Isolated",
        "invert": False,
    }
    (bundle / "tokenizer.json").write_text(json.dumps(tokenizer))
    rehash(bundle, "tokenizer.json")
    model = Model.load(bundle)
    with pytest.raises(BundleError, match="tokenizer.json failed on this text"):
        model.generate("a" * 20000 + "c", max_new_tokens=1)
    assert_one_error_line(invoke("run", bundle, "a" * 20000 + "c", "-n", "1"), "tokenizer.json failed")


def test_a_malformed_tokenizer_is_one_line(bundle, outside):
    (bundle / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    rehash(bundle, "tokenizer.json")
    refused_everywhere(bundle, outside, "tokenizer.json failed to load")


def test_unsigned_bundles_keep_loading(tiny_bundle):
    """Nothing above changes an honest bundle: it loads, with or without the full hash check."""
    assert Model.load(tiny_bundle, check_hashes=True).generate("def f(x):", max_new_tokens=3)
    assert not [check for check in verify(tiny_bundle) if check.status == "fail"]
