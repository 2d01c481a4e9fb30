"""Threads and spinning by measurement: the fastest measured setting is stored per bundle and machine and used by
later loads; a stored file is checked like any input; a busy machine's measurement is not kept."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from edgec.cli import main
from edgec.runtime import Model, backend_ort, calibration
from edgec.runtime.calibration import Setting, calibrate, candidates, resolve, stored_calibration


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEC_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("EDGEC_ORT_SPIN", raising=False)
    monkeypatch.setattr(calibration, "usable_cpus", lambda: 4)
    monkeypatch.setattr(backend_ort, "busy_elsewhere", lambda: 0.0)


def fake_times(table: dict[Setting, float]):
    tried = []

    def measure(bundle, setting, steps):
        tried.append(setting)
        return table[setting]

    return measure, tried


TABLE = {
    Setting(1, False): 30.0,
    Setting(2, True): 21.0,
    Setting(2, False): 26.0,
    Setting(4, True): 24.0,
    Setting(4, False): 19.5,
}


def test_candidates_cover_the_cores():
    assert candidates(1) == [Setting(1, False)]
    assert candidates(2) == [Setting(1, False), Setting(2, True), Setting(2, False)]
    assert [s.threads for s in candidates(6)] == [1, 2, 2, 4, 4, 6, 6]


def test_the_fastest_is_stored_and_used_by_the_next_load(tiny_bundle):
    measure, tried = fake_times(TABLE)
    result = calibrate(tiny_bundle, measure=measure)
    assert tried == candidates(4) + candidates(4)[::-1]  # two passes, the second in reverse order
    assert result.best == Setting(4, False) and result.stored is not None
    assert stored_calibration(tiny_bundle).step_ms == TABLE
    assert resolve(tiny_bundle, None, None, calibrate_missing=False) == (4, False)
    # a named thread count keeps its own measured spinning choice
    assert resolve(tiny_bundle, 2, None, calibrate_missing=False) == (2, True)
    assert resolve(tiny_bundle, 2, False, calibrate_missing=False) == (2, False)
    model = Model.load(tiny_bundle)
    options = model._backend.graph.session.get_session_options()
    assert (model.threads, model.spin) == (4, False)
    assert options.intra_op_num_threads == 4
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"


def test_a_drift_while_measuring_does_not_pick_the_setting(tiny_bundle, monkeypatch):
    """A machine that speeds up while it measures (another tenant finishing) makes whichever setting came last look
    faster in one pass; two mirrored passes weigh every setting alike. Here spinning is 1 ms a step faster and the
    machine 1.5 ms faster at each measurement."""
    monkeypatch.setattr(calibration, "usable_cpus", lambda: 2)
    base = {Setting(1, False): 30.0, Setting(2, True): 20.0, Setting(2, False): 21.0}
    calls = []

    def drifting(bundle, setting, steps):
        calls.append(setting)
        return base[setting] - 1.5 * (len(calls) - 1)

    assert calibrate(tiny_bundle, measure=drifting, rounds=1, store=False).best == Setting(2, False)
    calls.clear()
    result = calibrate(tiny_bundle, measure=drifting)
    assert result.best == Setting(2, True)
    assert result.passes[Setting(2, True)] == [18.5, 14.0] and result.step_ms[Setting(2, True)] == 16.25
    stored = json.loads(result.stored.read_text())
    assert stored["format"] == calibration.FORMAT == 2
    assert {(row["threads"], row["spin"]): row["passes"] for row in stored["step_ms"]}[(2, False)] == [18.0, 16.5]
    assert stored_calibration(tiny_bundle).step_ms == result.step_ms


def test_a_calibrated_spin_yields_to_a_busy_machine_at_load(tiny_bundle, monkeypatch):
    measure, _ = fake_times({Setting(1, False): 30.0, Setting(2, True): 10.0, Setting(2, False): 20.0})
    monkeypatch.setattr(calibration, "usable_cpus", lambda: 2)
    calibrate(tiny_bundle, measure=measure)
    assert resolve(tiny_bundle, None, None, calibrate_missing=False) == (2, True)
    monkeypatch.setattr(backend_ort, "busy_elsewhere", lambda: 1.5)
    monkeypatch.setattr(backend_ort.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    assert resolve(tiny_bundle, None, None, calibrate_missing=False) == (2, False)


def test_a_busy_machines_measurement_is_not_stored(tiny_bundle, monkeypatch):
    monkeypatch.setattr(backend_ort, "busy_elsewhere", lambda: 1.0)
    measure, _ = fake_times(TABLE)
    result = calibrate(tiny_bundle, measure=measure)
    assert result.best == Setting(4, False) and result.stored is None
    assert stored_calibration(tiny_bundle) is None


def test_nothing_stored_means_the_old_defaults_unless_asked(tiny_bundle, monkeypatch):
    assert resolve(tiny_bundle, None, None, calibrate_missing=False) == (None, None)
    measure, tried = fake_times(TABLE)
    monkeypatch.setattr(calibration, "decode_step_ms", measure)
    assert resolve(tiny_bundle, None, None, calibrate_missing=True) == (4, False)
    assert len(tried) == 10
    resolve(tiny_bundle, None, None, calibrate_missing=True)
    assert len(tried) == 10  # once: the second load reads the stored result


def test_a_rebuilt_bundle_or_another_machine_is_measured_anew(tiny_bundle, tmp_path, monkeypatch):
    import shutil

    measure, _ = fake_times(TABLE)
    calibrate(tiny_bundle, measure=measure)
    copy = shutil.copytree(tiny_bundle, tmp_path / "copy.edgec")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["source"]["note"] = "rebuilt"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert stored_calibration(copy) is None
    monkeypatch.setattr(calibration, "machine_key", lambda: "another CPU | 4 cpus | onnxruntime 0")
    assert stored_calibration(tiny_bundle) is None


@pytest.mark.parametrize(
    "edit",
    [
        lambda d: d.update(best={"threads": 64, "spin": False}),  # more threads than this machine may use
        lambda d: d.update(best={"threads": True, "spin": False}),  # a bool is not a count
        lambda d: d.update(best={"threads": 2, "spin": "yes"}),
        lambda d: d.update(best={"threads": 3, "spin": False}),  # not among what was measured
        lambda d: d["step_ms"][0].update(ms=-1),
        lambda d: d["step_ms"][0].update(ms="fast"),
        lambda d: d.update(bundle="0" * 64),
        lambda d: d.update(format=1),  # one pass, not the mean of two mirrored ones: measured again
        lambda d: d.pop("step_ms"),
        lambda d: d.update(step_ms=None),
    ],
)
def test_a_bad_stored_file_is_ignored(tiny_bundle, edit):
    measure, _ = fake_times(TABLE)
    path = calibrate(tiny_bundle, measure=measure).stored
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    assert stored_calibration(tiny_bundle) is None
    assert resolve(tiny_bundle, None, None, calibrate_missing=False) == (None, None)


@pytest.mark.parametrize("content", [b"{not json", b"[]", b"\xff\xfe", b" " * (calibration.MAX_FILE_BYTES + 1)])
def test_a_broken_stored_file_is_ignored(tiny_bundle, content):
    measure, _ = fake_times(TABLE)
    path = calibrate(tiny_bundle, measure=measure).stored
    path.write_bytes(content)
    assert stored_calibration(tiny_bundle) is None


def test_real_measurement_and_the_command(tiny_bundle, monkeypatch):
    monkeypatch.setattr(calibration, "usable_cpus", lambda: 2)
    ms = calibration.decode_step_ms(tiny_bundle, Setting(1, False), steps=4)
    assert 0 < ms < 5000
    # more steps than the context holds: as many as fit, not a prompt the bundle refuses
    assert 0 < calibration.decode_step_ms(tiny_bundle, Setting(1, False), steps=400) < 5000
    result = CliRunner().invoke(main, ["calibrate", str(tiny_bundle), "--steps", "4"])
    assert result.exit_code == 0, result.output
    assert "fastest:" in result.output and "stored:" in result.output
    assert set(stored_calibration(tiny_bundle).step_ms) == set(candidates(2))
    dry = CliRunner().invoke(main, ["calibrate", str(tiny_bundle), "--steps", "4", "--dry-run", "--max-threads", "1"])
    assert dry.exit_code == 0 and "stored:" not in dry.output


def test_the_command_refuses_a_bundle_without_cpu_threads(tiny_bundle, tmp_path):
    import shutil

    copy = shutil.copytree(tiny_bundle, tmp_path / "cuda.edgec")
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["runtime"]["providers"] = ["CUDAExecutionProvider", "CPUExecutionProvider"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(main, ["calibrate", str(copy)])
    assert result.exit_code != 0
    assert "CPU provider" in result.output and "Traceback" not in result.output
    missing = CliRunner().invoke(main, ["calibrate", str(tmp_path / "nothing.edgec")])
    assert missing.exit_code != 0 and "Traceback" not in missing.output


def test_the_environment_still_forces_spinning(tiny_bundle, monkeypatch):
    measure, _ = fake_times(TABLE)
    calibrate(tiny_bundle, measure=measure)
    monkeypatch.setenv("EDGEC_ORT_SPIN", "1")
    assert resolve(tiny_bundle, None, None, calibrate_missing=False) == (4, None)  # None: the variable decides
    model = Model.load(tiny_bundle)
    spinning = model._backend.graph.session.get_session_options().get_session_config_entry
    assert spinning("session.intra_op.allow_spinning") == "1"


def test_edgec_run_calibrates_once_unless_told_not_to(tiny_bundle, monkeypatch):
    monkeypatch.setattr(calibration, "usable_cpus", lambda: 2)
    measure, tried = fake_times({Setting(1, False): 5.0, Setting(2, True): 9.0, Setting(2, False): 7.0})
    monkeypatch.setattr(calibration, "decode_step_ms", measure)
    skipped = CliRunner().invoke(main, ["run", str(tiny_bundle), "Hello", "-n", "2", "-q", "--no-calibrate"])
    assert skipped.exit_code == 0, skipped.output
    assert tried == [] and stored_calibration(tiny_bundle) is None
    for _ in range(2):
        result = CliRunner().invoke(main, ["run", str(tiny_bundle), "Hello", "-n", "2", "-q"])
        assert result.exit_code == 0, result.output
    assert tried == candidates(2) + candidates(2)[::-1]  # measured by the first run only (two passes)
    assert stored_calibration(tiny_bundle).best == Setting(1, False)
    named = CliRunner().invoke(main, ["run", str(tiny_bundle), "Hello", "-n", "2", "-q", "--threads", "2"])
    assert named.exit_code == 0, named.output


def test_a_measurement_that_fails_does_not_stop_the_load(tiny_bundle, monkeypatch):
    def broken(bundle, setting, steps):
        raise RuntimeError("no\nway")

    monkeypatch.setattr(calibration, "decode_step_ms", broken)
    assert resolve(tiny_bundle, None, None, calibrate_missing=True) == (None, None)
    assert Model.load(tiny_bundle, calibrate=True).threads is None
    assert stored_calibration(tiny_bundle) is None


@pytest.fixture(scope="module")
def split_bundle(tmp_path_factory, tiny_tokenizer):
    """An int4 bundle from a GGUF: decode on model.onnx, prompt chunks on their own graph (prefill.onnx)."""
    pytest.importorskip("gguf")
    from edgec.build import BuildSettings, build
    from tests.tiny_gguf import write_tiny_llama_gguf

    gguf_file = write_tiny_llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_tokenizer)
    out = tmp_path_factory.mktemp("bundles") / "split.edgec"
    build(gguf_file, out, BuildSettings(context=128, prefill_chunk=32, weights="int4"))
    return out


def test_a_calibrated_load_reads_prompts_on_every_core(split_bundle):
    """The calibration's setting is for decode steps; the prompt-chunk graph's large products get every usable core
    (4 here) — unless the caller names a thread count, which both graphs then use."""
    measure, _ = fake_times(TABLE | {Setting(1, False): 10.0})  # 1 thread decodes fastest
    calibrate(split_bundle, measure=measure)
    model = Model.load(split_bundle)
    backend = model._backend
    assert backend.prefill is not None
    decode = backend.graph.session.get_session_options()
    prompt = backend.prefill.session.get_session_options()
    assert (model.threads, decode.intra_op_num_threads) == (1, 1)
    assert prompt.intra_op_num_threads == 4
    named = Model.load(split_bundle, threads=2)._backend
    assert named.graph.session.get_session_options().intra_op_num_threads == 2
    assert named.prefill.session.get_session_options().intra_op_num_threads == 2
    ids = model.tokenizer.encode("Hello there, a prompt of a few chunks " * 4)
    assert len(ids) > 32 and len(list(model.generate_ids(ids, max_new_tokens=3))) == 3  # chunks, then decode steps
    # a calibration that already uses every core: both sessions as measured (its spinning choice included)
    calibrate(split_bundle, measure=fake_times(TABLE)[0])  # fastest: 4 threads, not spinning
    both = Model.load(split_bundle)._backend
    for session in (both.graph.session, both.prefill.session):
        options = session.get_session_options()
        assert options.intra_op_num_threads == 4
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
