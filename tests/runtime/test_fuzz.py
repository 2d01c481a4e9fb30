"""Hypothesis fuzz of the runtime API: any argument gives a result or one of the documented exceptions
(GenerationError, a ValueError; TypeError) — never another exception, a crash or a hang."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgec.errors import GenerationError
from edgec.runtime import Model

DOCUMENTED = (GenerationError, TypeError)

prompts = st.one_of(
    st.text(max_size=300),
    st.lists(st.integers(min_value=-(2**40), max_value=2**40), max_size=200),
    st.lists(st.integers(min_value=0, max_value=383), min_size=1, max_size=200),
    st.none(),
    st.integers(),
    st.floats(allow_nan=True),
    st.binary(max_size=20),
    st.lists(st.floats(allow_nan=True), max_size=5),
)
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(2**70), 2**70),
    st.none(),
    st.text(max_size=3),
    st.booleans(),
)
token_counts = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**63), st.floats(allow_nan=True), st.none(), st.text(max_size=3)
)
stops = st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), st.integers())


@pytest.fixture(scope="module")
def model(tiny_bundle) -> Model:
    return Model.load(tiny_bundle)


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    prompt=prompts,
    max_new_tokens=token_counts,
    temperature=numbers,
    top_k=numbers,
    top_p=numbers,
    seed=numbers,
    stop=stops,
    stream=st.booleans(),
    chat=st.booleans(),
)
def test_generate_never_crashes(model, prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, stream, chat):
    kwargs = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop=stop,
        stream=stream,
        chat=chat,
    )
    try:
        result = model.generate(prompt, **kwargs)
        text = "".join(result) if stream else result
    except DOCUMENTED:
        return
    assert isinstance(text, str)
    # it succeeded, so the arguments were valid ones
    assert isinstance(max_new_tokens, int) and max_new_tokens >= 0
    assert isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature >= 0


@settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
@given(ids=prompts)
def test_logprobs_never_crashes(model, ids):
    try:
        result = model.logprobs(ids)
    except DOCUMENTED:
        return
    assert result.shape == (len(ids) - 1,) and (result <= 1e-6).all()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    prompt=st.lists(st.integers(min_value=0, max_value=383), min_size=1, max_size=130),
    max_new_tokens=st.integers(min_value=0, max_value=10**12),
    temperature=st.floats(min_value=0, max_value=50),
    top_k=st.integers(min_value=0, max_value=10**6),
    top_p=st.floats(min_value=1e-9, max_value=1.0),
    seed=st.one_of(st.none(), st.integers(min_value=0, max_value=2**63)),
)
def test_valid_arguments_always_generate(model, prompt, max_new_tokens, temperature, top_k, top_p, seed):
    """Huge max_new_tokens ends at the context; any valid sampling setting yields valid token ids."""
    try:
        tokens = list(
            model.generate_ids(
                prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
            )
        )
    except GenerationError as error:
        assert len(prompt) > model.context, error  # the only valid-looking input it may refuse
        return
    assert len(tokens) <= min(max_new_tokens, model.context - len(prompt) + 1)
    assert all(0 <= t < model.vocab_size for t in tokens)
