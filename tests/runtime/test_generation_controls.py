"""Repetition penalty, stop strings, generation stats and a caller's chat format, on the tiny bundle."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgec.errors import ChatTemplateError, GenerationError
from edgec.runtime import GenerationStats, Model
from edgec.runtime.model import _cut_at_stops
from edgec.runtime.sampling import SeenTokens, penalize_repeats
from tests.conftest import CHATML

PROMPT = "The built-in function len() returns"


@pytest.fixture(scope="module")
def model(tiny_bundle) -> Model:
    loaded = Model.load(tiny_bundle)
    loaded.eos_token_ids = set()  # random weights: never stop early, so every test sees its full length
    return loaded


# --- repetition penalty ---------------------------------------------------------------------------------------
def test_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -2.0, 3.0, -1.0, 0.0], dtype=np.float32)
    kept = logits.copy()
    out = penalize_repeats(logits, np.array([0, 1, 1, 4]), 2.0)  # a duplicate id is harmless
    np.testing.assert_array_equal(out, [1.0, -4.0, 3.0, -1.0, 0.0])
    np.testing.assert_array_equal(logits, kept)  # the caller's logits (a reused backend buffer) are not touched
    np.testing.assert_array_equal(penalize_repeats(logits, np.array([0, 1]), 1.0), logits)
    np.testing.assert_array_equal(penalize_repeats(logits, np.array([], dtype=np.int64), 3.0), logits)


def test_seen_tokens_keeps_each_id_once():
    seen = SeenTokens(np.array([5, 3, 5, 9]), vocab_size=16, room=4)
    assert sorted(seen.ids.tolist()) == [3, 5, 9]
    for token in (3, 7, 7, 1):
        seen.add(token)
    assert sorted(seen.ids.tolist()) == [1, 3, 5, 7, 9]


def _reference_penalized_greedy(model: Model, ids: list[int], penalty: float, steps: int) -> list[int]:
    """The rule written out token by token: every id in the prompt or output so far, divided if positive,
    multiplied if negative, then argmax."""
    out: list[int] = []
    for _ in range(steps):
        logits = model.next_token_logits(ids + out).astype(np.float64)
        for token in set(ids + out):
            logits[token] = logits[token] / penalty if logits[token] > 0 else logits[token] * penalty
        out.append(int(np.argmax(logits)))
    return out


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_penalized_greedy_matches_the_rule(model, penalty):
    ids = model.encode(PROMPT)
    got = list(model.generate_ids(ids, max_new_tokens=12, repeat_penalty=penalty))
    assert got == _reference_penalized_greedy(model, ids, penalty, 12)


def test_a_strong_penalty_changes_the_output(model):
    ids = model.encode(PROMPT)
    plain = list(model.generate_ids(ids, max_new_tokens=24))
    penalized = list(model.generate_ids(ids, max_new_tokens=24, repeat_penalty=50.0))
    assert penalized != plain
    assert len(set(penalized)) > len(set(plain)) or len(set(penalized)) == len(penalized)


@pytest.mark.parametrize("penalty", [0, -1.0, math.nan, math.inf])
def test_bad_penalties_are_refused(model, penalty):
    with pytest.raises(GenerationError, match="repeat_penalty"):
        model.generate(PROMPT, repeat_penalty=penalty)
    with pytest.raises(TypeError):
        model.generate(PROMPT, repeat_penalty="1.1")


# --- stop strings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "pieces,stops,want",
    [
        (["ab", "cE", "ND", "xy"], ["END"], ["ab", "c"]),  # a stop split over pieces; nothing of it comes out
        (["hello wor", "ld"], ["o w", "ld"], ["hell"]),  # the earliest stop wins
        (["STOP", "more"], ["STOP"], [""]),
        (["no stop", " here"], ["zz"], ["no sto", "p her", "e"]),  # held back only as long as a stop could start
        (["a", "b", "c", "d"], ["cd"], ["a", "b", ""]),
    ],
)
def test_cut_at_stops(pieces, stops, want):
    assert list(_cut_at_stops(iter(pieces), stops)) == want


def test_no_token_is_computed_after_a_stop(model):
    ids = model.encode(PROMPT)
    tokens = list(model.generate_ids(ids, max_new_tokens=30))
    text = model.decode(tokens)
    stop, needed = _visible_stop(model, tokens, text)
    stats = GenerationStats()
    assert model.generate(ids, max_new_tokens=30, stop=stop, stats=stats) == text[: text.index(stop)]
    assert stats.new_tokens == needed < 30


def _visible_stop(model: Model, tokens: list[int], text: str) -> tuple[str, int]:
    """Three characters from the middle of ``text`` and how many tokens show them: the first that are whole
    characters and are shown whole by those tokens. A tiny random model also emits bytes of characters that never
    complete (U+FFFD), which the text stream holds back until the next token — a stop ending there is seen a token
    later, by design."""
    for start in range(10, len(text) - 3):
        stop = text[start : start + 3]
        if "\ufffd" in stop:
            continue
        needed = next(k for k in range(1, len(tokens) + 1) if stop in model.decode(tokens[:k]))
        if not model.decode(tokens[:needed]).endswith("\ufffd"):
            return stop, needed
    raise AssertionError(f"no stop to try in {text!r}")


# --- stats ----------------------------------------------------------------------------------------------------
def test_stats_count_and_time_the_generation(model):
    stats = GenerationStats()
    ids = model.encode(PROMPT)
    pieces = list(model.generate(ids, max_new_tokens=10, stats=stats, stream=True))
    assert pieces
    assert stats.prompt_tokens == len(ids) and stats.new_tokens == 10
    assert 0 < stats.prompt_seconds <= stats.first_token_seconds
    assert stats.decode_seconds > 0 and stats.decode_tokens_per_second > 0 and stats.prompt_tokens_per_second > 0
    line = stats.line()
    assert "tok/s" in line and "time to first token" in line and "\n" not in line


# --- multi-turn chat and a caller's chat format -----------------------------------------------------------------
def test_chat_template_text_gives_the_bundles_format(tiny_bundle):
    from edgec.chat_template import chat_format_from_template

    fresh = Model.load(tiny_bundle)
    derived = chat_format_from_template(CHATML, **fresh.special_tokens())
    assert derived == fresh.tokenizer.chat_format
    assert fresh.special_tokens() == {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}


def test_set_chat_format_is_used_for_messages(tiny_bundle):
    from edgec.chat_template import chat_format_from_template

    fresh = Model.load(tiny_bundle)
    template = (
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    fresh.set_chat_format(chat_format_from_template(template))
    messages = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ]
    rendered = "[system]S\n[user]a\n[assistant]b\n[user]c\n[assistant]"
    assert fresh.tokenizer.encode_chat(messages) == fresh.tokenizer.encode(rendered, add_special_tokens=False)
    assert fresh.generate(messages=messages, max_new_tokens=5) == fresh.generate(
        fresh.tokenizer.encode(rendered, add_special_tokens=False), max_new_tokens=5
    )
    with pytest.raises(TypeError):
        fresh.set_chat_format("not a format")


@pytest.mark.parametrize(
    "template,needle",
    [
        ("{% for m in messages %}{{ m['content'] }", "not valid Jinja"),
        ("{{ raise_exception('no system messages') }}", "no system messages"),
        ("{% for m in messages %}{{ m['content'] }}{{ m['content'] }}{% endfor %}", "cannot be used"),
    ],
)
def test_unusable_templates_are_refused(template, needle):
    from edgec.chat_template import chat_format_from_template

    with pytest.raises(ChatTemplateError, match=needle):
        chat_format_from_template(template)


def test_kv_capacity_zero_is_refused_not_the_bundles():
    from edgec.errors import BuildSettingsError
    from edgec.kvcache.compression import Compression

    with pytest.raises(BuildSettingsError, match="--kv-capacity must be a number ≥ 1"):
        Compression(capacity=128).override(16, capacity=0)
    with pytest.raises(BuildSettingsError, match="--kv-capacity must be a number ≥ 1"):
        Compression(capacity=0).check(16, 256)


def test_runtime_only_command_takes_stop_and_penalty(tiny_bundle, model, capsys):
    from edgec.runtime.__main__ import main

    text = model.generate(PROMPT, max_new_tokens=12, repeat_penalty=1.2)
    stop = text[4:7]
    assert main([str(tiny_bundle), PROMPT, "-n", "12", "--repeat-penalty", "1.2", "--stop", stop]) == 0
    out, err = capsys.readouterr()
    assert out == text[: text.index(stop)] + "\n"
    assert "tok/s" in err
    assert main([str(tiny_bundle), PROMPT, "--repeat-penalty", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: repeat_penalty must be")
