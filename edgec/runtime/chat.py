"""Chat formatting without a template engine.

A build renders the model's Jinja chat template on sentinel conversations and keeps what it learns as
plain strings (``ChatFormat``), checked against the template on several conversations. The runtime then
formats messages with string concatenation: no jinja2 on the deployment machine.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from edgec.errors import GenerationError


@dataclass(frozen=True)
class ChatFormat:
    """Text around each message, per role; ``preamble`` opens a conversation that has no system message."""

    system: tuple[str, str]
    user: tuple[str, str]
    assistant: tuple[str, str]
    preamble: str
    generation_prompt: str

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not isinstance(messages, list) or not messages:
            raise GenerationError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        parts = []
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise GenerationError(f"message {index} must be a dict with a string 'content'")
            role = message.get("role")
            if role not in ("system", "user", "assistant"):
                raise GenerationError(f"message {index} has role {role!r}; use system, user or assistant")
            if role == "system" and index != 0:
                raise GenerationError("a system message may only come first")
            if index == 0 and role != "system":
                parts.append(self.preamble)
            before, after = getattr(self, role)
            parts += [before, message["content"], after]
        if add_generation_prompt:
            parts.append(self.generation_prompt)
        return "".join(parts)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> ChatFormat:
        return cls(
            system=tuple(data["system"]),
            user=tuple(data["user"]),
            assistant=tuple(data["assistant"]),
            preamble=data["preamble"],
            generation_prompt=data["generation_prompt"],
        )
