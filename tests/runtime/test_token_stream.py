"""The streamed text of generated tokens (``BundleTokenizer.stream``) joins to what ``decode`` gives for them."""

from __future__ import annotations

import random

import pytest

from edgec.runtime.tokenizer import BundleTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_bundle) -> BundleTokenizer:
    return BundleTokenizer(tiny_bundle / "tokenizer.json", None)


def _partial_character(tokenizer: BundleTokenizer) -> int:
    """A token that is the first byte of a two-byte character alone: it decodes to U+FFFD."""
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == "\ufffd")


def test_a_partial_character_is_held_back_until_the_next_token(tokenizer):
    partial = _partial_character(tokenizer)
    abc = tokenizer.encode("abc", add_special_tokens=False)
    ids = abc + [partial] + tokenizer.encode("d", add_special_tokens=False)
    pieces = list(tokenizer.stream(iter(ids)))
    assert not any(piece.endswith("\ufffd") for piece in pieces[:-1])
    assert "".join(pieces) == tokenizer.decode(ids)


def test_what_is_held_when_the_tokens_end_is_not_lost(tokenizer):
    """A generation cut after a token holding part of a character (max_new_tokens, or a model emitting an invalid
    byte) still shows it, as decode does: before, the stream dropped it and one new token gave no text at all."""
    partial = _partial_character(tokenizer)
    assert "".join(tokenizer.stream(iter([partial]))) == "\ufffd" == tokenizer.decode([partial])
    ids = tokenizer.encode("abc", add_special_tokens=False) + [partial]
    assert "".join(tokenizer.stream(iter(ids))) == tokenizer.decode(ids) == "abc\ufffd"


def test_any_token_sequence_streams_to_its_decoded_text(tokenizer):
    draw = random.Random(0)
    for _ in range(300):
        ids = [draw.randrange(tokenizer.vocab_size) for _ in range(draw.randrange(1, 12))]
        assert "".join(tokenizer.stream(iter(ids))) == tokenizer.decode(ids), ids
