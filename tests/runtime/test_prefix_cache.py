"""Saved prompts (prefix_cache.py): a restored state answers exactly as the prompt read again; a longer prompt reads
only its rest; ``edgec run --prefix-cache`` skips the prefill the second time; a state file is hostile input."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from click.testing import CliRunner

from edgec.cli import main
from edgec.errors import GenerationError, StateFileError
from edgec.runtime import Model
from edgec.runtime import prefix_cache as pc
from tests.conftest import pydoc_text
from tests.hostile import fifo_in_place_of, raised_within
from tests.test_cli import assert_clean_failure


@pytest.fixture(scope="module")
def compressed_bundle(tiny_rotated_bundle):
    return tiny_rotated_bundle


@pytest.fixture(scope="module")
def ids(tiny_bundle):
    return Model.load(tiny_bundle).encode(pydoc_text()[:4000])[:110]


def test_restored_state_answers_as_the_prompt_read_again(compressed_bundle, ids, tmp_path):
    """A compressed cache (rotated, evicting: 90 tokens into 40 slots), saved and loaded in another Model:
    the same state bytes, the same first logits, the same greedy tokens — without reading the prompt."""
    prompt = ids[:90]
    writer = Model.load(compressed_bundle)
    writer.save_state(tmp_path / "p.edgeckv", prompt)
    cold = writer.generate_ids(prompt, max_new_tokens=12)
    cold_tokens, cold_state = list(cold), writer._idle[-1].arrays()

    reader = Model.load(compressed_bundle)
    saved = reader.load_state(tmp_path / "p.edgeckv")
    assert saved.ids.tolist() == list(prompt)
    reader._prefill = None  # any attempt to read the prompt again fails
    assert list(reader.generate_ids(prompt, max_new_tokens=12, saved=saved)) == cold_tokens
    for name, value in reader._idle[-1].arrays().items():  # after the same 11 decode steps
        np.testing.assert_array_equal(value, cold_state[name], err_msg=name)
    with pytest.raises(GenerationError, match="not the start of this prompt"):
        reader.generate_ids(ids[1:91], saved=saved)


def test_a_longer_prompt_reads_only_its_rest(tiny_bundle, ids, tmp_path, monkeypatch):
    """Plain cache: document saved, document + question restored then 20 more tokens read = read whole (float
    rounding: the chunks fall elsewhere); the rest's chunks before its last ask for no logits."""
    from edgec.runtime import backend_ort

    fed = []
    feed = backend_ort.OrtCacheState.feed
    monkeypatch.setattr(
        backend_ort.OrtCacheState,
        "feed",
        lambda self, chunk, *args, **kw: fed.append(len(chunk)) or feed(self, chunk, *args, **kw),
    )
    model = Model.load(tiny_bundle)
    model.save_state(tmp_path / "doc.edgeckv", ids[:80])
    saved = model.load_state(tmp_path / "doc.edgeckv")
    whole = model.next_token_logits(ids[:100])
    with model._state() as state:
        fed.clear()
        restored = model._read_prompt(state, np.asarray(ids[:100]), None, saved, None)
    assert fed == [16]  # 80–96 fed without logits, 96–100 run for them
    np.testing.assert_allclose(restored, whole, atol=2e-4)
    assert restored.argmax() == whole.argmax()


def test_run_prefix_cache_skips_the_prefill_the_second_time(compressed_bundle, ids, tmp_path, monkeypatch):
    folder = tmp_path / "prompts"
    prompt = Model.load(compressed_bundle).decode(ids[:100])
    args = ["run", str(compressed_bundle), prompt, "-n", "8", "-q", "--prefix-cache", str(folder)]
    first = CliRunner().invoke(main, args)
    assert first.exit_code == 0, first.output
    files = list(folder.iterdir())
    assert len(files) == 1 and files[0].suffix == ".edgeckv"
    assert files[0].stat().st_size < 100_000  # 2 layers × 2 KV heads × 40 fp32 slots, the logits, the ids

    def no_prefill(*args, **kwargs):
        raise AssertionError("the prompt was read again")

    monkeypatch.setattr(Model, "_prefill", no_prefill)
    second = CliRunner().invoke(main, args)
    assert second.exit_code == 0, second.output
    assert second.output == first.output
    # a prompt that starts with the saved one restores it and reads the rest: a second, longer file
    longer = CliRunner().invoke(main, [*args[:2], prompt + " and more words", *args[3:]])
    assert longer.exit_code == 0, longer.output
    assert len(list(folder.iterdir())) == 2


def _tamper(path, edit):
    raw = path.read_bytes()
    length = struct.unpack("<I", raw[8:12])[0]
    header = json.loads(raw[12 : 12 + length])
    body = bytearray(raw[12 + length :])
    edit(header, body)
    encoded = json.dumps(header).encode()
    path.write_bytes(raw[:8] + struct.pack("<I", len(encoded)) + encoded + bytes(body))


def _pos_offset(header):
    offset = 0
    for entry in header["arrays"]:
        size = np.dtype(entry["dtype"]).itemsize * int(np.prod(entry["shape"]))
        if entry["name"].endswith(".pos"):
            return offset
        offset += size
    raise AssertionError("no pos tensor")


def _resign(header, body):
    import hashlib

    header["payload_sha256"] = hashlib.sha256(bytes(body)).hexdigest()


def _out_of_range_positions(header, body):
    body[_pos_offset(header) : _pos_offset(header) + 8] = struct.pack("<q", 10_000)
    _resign(header, body)


DAMAGES = [
    (lambda p: p.write_bytes(b"PK\x03\x04 not ours"), "not an edgec cache state file"),
    (lambda p: p.write_bytes(p.read_bytes()[:-10]), "shorter than its header says"),
    (lambda p: p.write_bytes(p.read_bytes() + b"x"), "longer than its header says"),
    (lambda p: p.write_bytes(p.read_bytes()[:8] + struct.pack("<I", 1 << 30)), "at most"),
    (lambda p: p.write_bytes(p.read_bytes()[:12] + b"{" * 40), "not JSON"),
    (lambda p: _tamper(p, lambda h, b: b.__setitem__(-1, b[-1] ^ 1)), "damaged"),
    (lambda p: _tamper(p, lambda h, b: h.update(identity="0" * 64)), "another bundle or cache setting"),
    (lambda p: _tamper(p, lambda h, b: h["arrays"][2]["shape"].__setitem__(2, 4000)), "this bundle's is"),
    (lambda p: _tamper(p, lambda h, b: h.update(tokens=10**9)), "context is 128"),
    (lambda p: _tamper(p, _out_of_range_positions), "positions outside the saved prompt"),
]


def test_a_state_file_is_hostile_input(compressed_bundle, ids, tmp_path):
    """Every damaged or foreign file: StateFileError from load_state, one error line from edgec run."""
    model = Model.load(compressed_bundle)
    prompt = model.decode(ids[:60])
    prompt_ids = np.asarray(model.encode(prompt))
    name = pc.prefix_keys(model._cache_identity(), prompt_ids, np.zeros(len(prompt_ids), bool))[-1] + pc.SUFFIX
    model.save_state(tmp_path / "good", prompt_ids)
    for case, (damage, needle) in enumerate(DAMAGES):
        folder = tmp_path / str(case)
        folder.mkdir()
        (folder / name).write_bytes((tmp_path / "good").read_bytes())
        damage(folder / name)
        with pytest.raises(StateFileError, match=needle):
            model.load_state(folder / name)
        args = ["run", str(compressed_bundle), prompt, "-n", "2", "-q", "--prefix-cache", str(folder)]
        assert_clean_failure(CliRunner().invoke(main, args), needle)


def test_a_state_of_another_bundle_is_refused(compressed_bundle, tiny_bundle, ids, tmp_path):
    Model.load(tiny_bundle).save_state(tmp_path / "plain.edgeckv", ids[:20])
    with pytest.raises(StateFileError, match="another bundle or cache setting"):
        Model.load(compressed_bundle).load_state(tmp_path / "plain.edgeckv")
    Model.load(compressed_bundle).save_state(tmp_path / "c.edgeckv", ids[:20])
    with pytest.raises(StateFileError, match="this bundle's is"):  # another capacity: another state
        Model.load(compressed_bundle, kv_capacity=32).load_state(tmp_path / "c.edgeckv")
    assert pc.find_prefix(tmp_path / "missing", ["a"]) is None


def test_a_named_pipe_in_the_prefix_cache_is_refused_without_waiting(compressed_bundle, ids, tmp_path):
    """A state file that is a named pipe (``load_state``, or found in ``--prefix-cache``): refused at once, where
    a plain open would wait for a writer forever."""
    model = Model.load(compressed_bundle)
    prompt = model.decode(ids[:60])
    prompt_ids = np.asarray(model.encode(prompt))
    name = pc.prefix_keys(model._cache_identity(), prompt_ids, np.zeros(len(prompt_ids), bool))[-1] + pc.SUFFIX
    pipe = fifo_in_place_of(tmp_path / name)
    error = raised_within(30, lambda: model.load_state(pipe), pipe)
    assert isinstance(error, StateFileError) and "is not a regular file" in str(error), error
    args = ["run", str(compressed_bundle), prompt, "-n", "2", "-q", "--prefix-cache", str(tmp_path)]
    results = []
    assert raised_within(30, lambda: results.append(CliRunner().invoke(main, args)), pipe) is None
    assert_clean_failure(results[0], "not a regular file")
