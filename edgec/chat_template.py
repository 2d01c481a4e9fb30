"""Derive a runtime ``ChatFormat`` from a tokenizer's Jinja chat template (build side)."""

from __future__ import annotations

from collections.abc import Callable

from edgec.runtime.chat import ChatFormat

_MARK = "\x01EDGEC\x01"
_SYSTEM_MARK = "\x02EDGEC\x02"

_CHECKS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
    ],
    [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}],
]


def _split(text: str, mark: str) -> tuple[str, str]:
    if text.count(mark) != 1:
        raise ValueError("content not rendered exactly once")
    before, after = text.split(mark)
    return before, after


def derive_chat_format(render: Callable[[list[dict], bool], str]) -> ChatFormat:
    """``render(messages, add_generation_prompt)`` is the template; raises ValueError when it is not
    expressible as per-role wrappers (then the bundle has no chat support and says so)."""
    system_only = render([{"role": "system", "content": _SYSTEM_MARK}], False)
    system = _split(system_only, _SYSTEM_MARK)
    wrappers = {}
    for role in ("user", "assistant"):
        text = render([{"role": "system", "content": _SYSTEM_MARK}, {"role": role, "content": _MARK}], False)
        if not text.startswith(system_only):
            raise ValueError("a system message changes what follows it")
        wrappers[role] = _split(text[len(system_only) :], _MARK)
    user_only = render([{"role": "user", "content": _MARK}], False)
    opening = user_only[: user_only.index(_MARK)]
    if not opening.endswith(wrappers["user"][0]):
        raise ValueError("user messages are wrapped differently without a system message")
    preamble = opening[: len(opening) - len(wrappers["user"][0])]
    with_prompt = render([{"role": "user", "content": _MARK}], True)
    if not with_prompt.startswith(user_only):
        raise ValueError("the generation prompt changes earlier text")
    chat = ChatFormat(
        system=system,
        user=wrappers["user"],
        assistant=wrappers["assistant"],
        preamble=preamble,
        generation_prompt=with_prompt[len(user_only) :],
    )
    for messages in _CHECKS:
        for add_prompt in (False, True):
            if chat.render(messages, add_prompt) != render(messages, add_prompt):
                raise ValueError("the template does not reduce to per-role wrappers")
    return chat


def chat_format_from_tokenizer(tokenizer) -> tuple[ChatFormat | None, str]:
    """(format, note) for a transformers tokenizer; format is None when there is no usable template."""
    if not getattr(tokenizer, "chat_template", None):
        return None, "the tokenizer has no chat template"

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    try:
        return derive_chat_format(render), "derived from the tokenizer's chat template and checked against it"
    except Exception as error:  # any template the wrapper form cannot express
        return None, f"chat template not supported by the runtime: {error}"


def chat_format_from_template(template: str, bos_token: str = "", eos_token: str = "") -> ChatFormat:
    """The runtime's ``ChatFormat`` from a Jinja chat template's text (``--chat-template FILE``), rendered as
    transformers renders chat templates (a sandbox, ``trim_blocks``/``lstrip_blocks``, ``bos_token``/``eos_token``
    and ``raise_exception`` defined); ChatTemplateError when it is not valid Jinja or not per-role wrappers."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from edgec.errors import ChatTemplateError

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    environment.globals["raise_exception"] = raise_exception
    try:
        compiled = environment.from_string(template)
    except TemplateError as error:
        raise ChatTemplateError(f"the chat template is not valid Jinja: {error}") from None

    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return compiled.render(
            messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token, eos_token=eos_token
        )

    try:
        return derive_chat_format(render)
    except Exception as error:  # the template's own errors (raise_exception, undefined names) or its shape
        raise ChatTemplateError(
            f"the chat template cannot be used: {error} (the runtime needs a template that wraps each message "
            "in fixed text per role)"
        ) from None


def read_chat_template(path) -> str:
    """A chat template file's text: a Jinja template, or a tokenizer_config.json / chat_template.json holding one
    under "chat_template"."""
    import json
    from pathlib import Path

    from edgec.errors import ChatTemplateError

    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reason = error.strerror if isinstance(error, OSError) and error.strerror else type(error).__name__
        raise ChatTemplateError(f"cannot read the chat template {path}: {reason}") from None
    if path.suffix == ".json":
        try:
            text = json.loads(text)["chat_template"]
        except (ValueError, KeyError, TypeError):
            raise ChatTemplateError(f'{path} has no "chat_template" string') from None
        if not isinstance(text, str):
            raise ChatTemplateError(f'{path}: "chat_template" is not one template string')
    if not text.strip():
        raise ChatTemplateError(f"the chat template {path} is empty")
    return text
