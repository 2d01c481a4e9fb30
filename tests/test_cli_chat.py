"""edgec chat, run's prompt sources, stats and chat templates, plan's build line and --memory, plain progress and
tables when not on a terminal; every bad input: one ``error:`` line, exit 2."""

from __future__ import annotations

import json
import re
import shlex
import shutil

import pytest
from click.testing import CliRunner

from edgec.cli import main, terminal_text
from edgec.runtime import Model
from tests.conftest import CHATML
from tests.test_cli import assert_clean_failure


def invoke(*args, input: str | None = None):
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


@pytest.fixture(scope="module")
def model(tiny_bundle) -> Model:
    return Model.load(tiny_bundle)


@pytest.fixture(scope="module")
def base_bundle(tiny_bundle, tmp_path_factory):
    """The tiny bundle as a base model's would be: no chat format (the manifest is not among the hashed files)."""
    copy = tmp_path_factory.mktemp("base") / "base.edgec"
    shutil.copytree(tiny_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer"]["chat_format"] = None
    manifest["tokenizer"]["chat_note"] = "the tokenizer has no chat template"
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


@pytest.fixture(scope="module")
def chatml_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "chatml.jinja"
    path.write_text(CHATML)
    return path


# --- run ------------------------------------------------------------------------------------------------------
def test_run_prints_the_answer_then_one_stats_line_on_stderr(tiny_bundle, model):
    result = invoke("run", tiny_bundle, "def f(x):", "-n", "8")
    assert result.exit_code == 0, result.output
    assert result.stdout == terminal_text(model.generate("def f(x):", max_new_tokens=8)) + "\n"
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "tok/s" in lines[0] and "time to first token" in lines[0]
    assert invoke("run", tiny_bundle, "def f(x):", "-n", "8", "--quiet").stderr == ""


def test_run_reads_the_prompt_from_stdin_or_a_file(tiny_bundle, tmp_path):
    want = invoke("run", tiny_bundle, "def f(x):", "-n", "6", "-q").stdout
    assert invoke("run", tiny_bundle, "-", "-n", "6", "-q", input="def f(x):\n").stdout == want
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("def f(x):\n")
    assert invoke("run", tiny_bundle, "--prompt-file", prompt, "-n", "6", "-q").stdout == want


def test_run_stop_and_repeat_penalty(tiny_bundle, model):
    prompt = "The built-in function len() returns"
    text = model.generate(prompt, max_new_tokens=20)
    stop = text[6:9]
    result = invoke("run", tiny_bundle, prompt, "-n", "20", "--stop", "@@@", "--stop", stop, "-q")
    assert result.stdout == terminal_text(text[: text.index(stop)]) + "\n"
    penalized = invoke("run", tiny_bundle, prompt, "-n", "20", "--repeat-penalty", "1.5", "-q")
    assert penalized.stdout == terminal_text(model.generate(prompt, max_new_tokens=20, repeat_penalty=1.5)) + "\n"


def test_chat_template_gives_a_base_bundle_chat(tiny_bundle, base_bundle, chatml_file, tmp_path):
    assert_clean_failure(invoke("run", base_bundle, "hello", "--chat"), "no chat format", "--chat-template")
    want = invoke("run", tiny_bundle, "hello", "--chat", "-n", "6", "-q").stdout
    assert invoke("run", base_bundle, "hello", "--chat-template", chatml_file, "-n", "6", "-q").stdout == want
    config = tmp_path / "tokenizer_config.json"  # as a Hugging Face folder holds it
    config.write_text(json.dumps({"chat_template": CHATML}))
    assert invoke("run", base_bundle, "hello", "--chat-template", config, "-n", "6", "-q").stdout == want


@pytest.mark.parametrize(
    "args,stdin,needles",
    [
        (["nope.edgec", "hi"], None, ["nope.edgec", "is not a folder"]),
        (["{bundle}", "-"], "", ["the prompt is empty", "stdin"]),
        (["{bundle}", "-"], "\n", ["the prompt is empty"]),
        (["{bundle}"], None, ["give a PROMPT"]),
        (["{bundle}", "hi", "--prompt-file", "{tmp}/p.txt"], None, ["not both"]),
        (["{bundle}", "--prompt-file", "{tmp}/missing.txt"], None, ["cannot read --prompt-file"]),
        (["{bundle}", "hi", "--repeat-penalty", "0"], None, ["--repeat-penalty must be a number > 0"]),
        (["{bundle}", "hi", "--repeat-penalty", "-1.5"], None, ["--repeat-penalty must be a number > 0"]),
        (["{bundle}", "hi", "--repeat-penalty", "nan"], None, ["--repeat-penalty must be a number > 0"]),
        (["{bundle}", "hi", "--chat-template", "{tmp}/missing.jinja"], None, ["cannot read the chat template"]),
        (["{bundle}", "hi", "--chat-template", "{tmp}"], None, ["cannot read the chat template"]),
        (["{bundle}", "hi", "--chat-template", "{tmp}/bad.jinja"], None, ["not valid Jinja"]),
        (["{bundle}", "hi", "--chat-template", "{tmp}/empty.jinja"], None, ["is empty"]),
        (["{bundle}", "hi", "--chat-template", "{tmp}/twice.jinja"], None, ["cannot be used", "per role"]),
        (["{bundle}", "hi", "--chat-template", "{tmp}/tokenizer_config.json"], None, ['no "chat_template"']),
        (["{bundle}", "hi", "--kv-capacity", "0"], None, ["compressed cache"]),
    ],
    ids=[
        "no-bundle",
        "empty-stdin",
        "blank-stdin",
        "no-prompt",
        "two-prompts",
        "missing-prompt-file",
        "penalty-0",
        "penalty-negative",
        "penalty-nan",
        "missing-template",
        "template-is-a-folder",
        "bad-jinja",
        "empty-template",
        "template-not-per-role",
        "json-without-template",
        "kv-capacity-0",
    ],
)
def test_run_bad_inputs(args, stdin, needles, tiny_bundle, tmp_path):
    (tmp_path / "p.txt").write_text("x")
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    (tmp_path / "empty.jinja").write_text("  \n")
    (tmp_path / "twice.jinja").write_text("{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    args = [a.format(bundle=tiny_bundle, tmp=tmp_path) for a in args]
    assert_clean_failure(invoke("run", *args, input=stdin), *needles)


# --- chat -----------------------------------------------------------------------------------------------------
def test_chat_is_multi_turn_with_a_system_message(tiny_bundle, model):
    result = invoke("chat", tiny_bundle, "--system", "Be brief.", "-n", "6", input="hello\nand then?\n/exit\n")
    assert result.exit_code == 0, result.output
    system = {"role": "system", "content": "Be brief."}
    first = model.generate(messages=[system, {"role": "user", "content": "hello"}], max_new_tokens=6)
    second = model.generate(
        messages=[
            system,
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": first.strip()},
            {"role": "user", "content": "and then?"},
        ],
        max_new_tokens=6,
    )
    assert result.stdout == f">>> {terminal_text(first)}\n>>> {terminal_text(second)}\n>>> "


def test_chat_commands_and_eof(tiny_bundle, model):
    result = invoke("chat", tiny_bundle, "-n", "4", input="/stats\nhello\n/stats\n/reset\nhello\n/nope\n")
    assert result.exit_code == 0, result.output  # EOF (Ctrl-D) ends the conversation cleanly
    answer = terminal_text(model.generate(messages=[{"role": "user", "content": "hello"}], max_new_tokens=4))
    # the commands' replies go to stderr; after /reset the same question gets the same answer
    assert result.stdout == f">>> >>> {answer}\n>>> >>> >>> {answer}\n>>> >>> \n"
    err = result.stderr
    assert "(no answer yet)" in err and "tok/s" in err and "time to first token" in err
    assert "(conversation cleared)" in err and "unknown command /nope" in err
    assert "Traceback" not in result.output


def test_chat_with_stop_and_a_template(base_bundle, chatml_file, model):
    answer = model.generate(messages=[{"role": "user", "content": "hello"}], max_new_tokens=12)
    stop = answer[3:6]
    result = invoke("chat", base_bundle, "--chat-template", chatml_file, "-n", "12", "--stop", stop, input="hello\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == f">>> {terminal_text(answer[: answer.index(stop)])}\n>>> \n"


def test_chat_keeps_going_after_a_turn_that_does_not_fit(tiny_bundle):
    result = invoke("chat", tiny_bundle, "-n", "2", input="word " * 400 + "\nhi\n")
    assert result.exit_code == 0, result.output
    assert "error: " in result.stderr and "/reset" in result.stderr
    assert result.stdout.count(">>> ") == 3


@pytest.mark.parametrize(
    "args,needles",
    [
        (["nope.edgec"], ["is not a folder"]),
        (["{base}"], ["no chat format", "--chat-template"]),
        (["{bundle}", "--repeat-penalty", "0"], ["--repeat-penalty must be a number > 0"]),
        (["{bundle}", "--chat-template", "{tmp}/missing.jinja"], ["cannot read the chat template"]),
    ],
    ids=["no-bundle", "base-without-template", "penalty-0", "missing-template"],
)
def test_chat_bad_inputs(args, needles, tiny_bundle, base_bundle, tmp_path):
    args = [a.format(bundle=tiny_bundle, base=base_bundle, tmp=tmp_path) for a in args]
    assert_clean_failure(invoke("chat", *args, input="hi\n"), *needles)


# --- plan, targets, build progress -------------------------------------------------------------------------------
def test_plan_prints_a_build_line_that_builds(tiny_llama, tmp_path):
    result = invoke("plan", tiny_llama, "--memory", "8GiB")
    assert result.exit_code == 0, result.output
    line = result.stdout.strip().splitlines()[-1]
    words = shlex.split(line)
    assert words[:3] == ["edgec", "build", str(tiny_llama)] and "--memory" in words
    out = tmp_path / "planned.edgec"
    words[words.index("-o") + 1] = str(out)
    built = invoke(*words[1:], "--context", "64")  # a shorter context than planned keeps the test fast
    assert built.exit_code == 0, built.output
    assert "\r" not in built.output  # not a terminal: plain lines, no live bars
    for stage in ("starting", "load (1/7)", "export (3/7)", "bundle (7/7)"):
        assert stage in built.output
    assert re.search(r"\] passes (\d+)/\1\n", built.output)  # inside the export stage: each graph pass
    layers = json.loads((tiny_llama / "config.json").read_text())["num_hidden_layers"]
    assert f"] trace layers {layers}/{layers}\n" in built.output  # inside the trace: each decoder layer
    assert "] to onnx 1/1\n" in built.output
    assert (out / "manifest.json").exists()


def test_plan_memory_changes_the_plan():
    big = invoke("plan", "llama-3-8b", "--target", "cpu", "--memory", "64GB")
    small = invoke("plan", "llama-3-8b", "--target", "cpu", "--memory", "8GiB")
    assert big.exit_code == 0 and small.exit_code == 0, big.output + small.output
    assert "of 59.60 GiB" in big.stdout and "of 8.00 GiB" in small.stdout
    assert "--weights fp32" in big.stdout and "--weights fp32" not in small.stdout
    assert "edgec build PATH/TO/llama-3-8b --target cpu" in big.stdout


@pytest.mark.parametrize(
    "memory,needle",
    [("lots", "--memory takes a size"), ("0GB", "more than 0"), ("-4GB", "--memory takes a size"), ("1MB", "usable")],
)
def test_plan_bad_memory(memory, needle):
    assert_clean_failure(invoke("plan", "smollm2-135m", "--memory", memory), needle)


def test_build_refuses_kv_capacity_zero(tiny_llama, tmp_path):
    assert_clean_failure(invoke("build", tiny_llama, "-o", tmp_path / "x", "--kv-capacity", "0"), "--kv-capacity")


def test_targets_are_not_truncated_when_piped():
    result = invoke("targets")
    assert result.exit_code == 0
    assert "…" not in result.stdout
    assert "fp32,fp16,fp8,int8,int4" in result.stdout and "rtx3060-laptop" in result.stdout


@pytest.mark.parametrize("command", ["chat", "plan", "run"])
def test_new_help_has_examples(command):
    result = invoke(command, "--help")
    assert result.exit_code == 0 and "Example:" in result.output and f"edgec {command} " in result.output
