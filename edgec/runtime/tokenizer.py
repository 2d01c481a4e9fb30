"""The bundle's tokenizer (``tokenizers`` only) with chat formatting and streaming detokenization."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from edgec.errors import BundleError, GenerationError, one_line
from edgec.runtime.chat import ChatFormat


@contextlib.contextmanager
def _tokenizer_errors(path: Path, doing: str) -> Iterator[None]:
    """A tokenizer.json from a bundle may be malformed or hostile: its failures are BundleErrors. A regex that
    backtracks past Oniguruma's limit makes the tokenizers library panic, and its PanicException derives from
    BaseException (so ``except Exception`` misses it)."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as error:
        if not isinstance(error, Exception) and type(error).__name__ != "PanicException":
            raise
        raise BundleError(f"the bundle's {path.name} failed {doing}: {one_line(error, 200)}") from None


class BundleTokenizer:
    def __init__(self, path: Path, chat_format: ChatFormat | None, chat_note: str = "") -> None:
        self.path = path
        with _tokenizer_errors(path, "to load"):
            self.tokenizer = Tokenizer.from_file(str(path))
            self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.chat_format = chat_format
        self.chat_note = chat_note

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, not {type(text).__name__}")
        with _tokenizer_errors(self.path, "on this text"):
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if self.chat_format is None:
            raise GenerationError(
                f"this bundle has no chat format ({self.chat_note}); pass a plain prompt, or give a chat template "
                "(edgec run/chat --chat-template FILE; Model.set_chat_format)"
            )
        # the rendered text already carries the template's special tokens (BOS included where it has one)
        return self.encode(self.chat_format.render(messages), add_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        with _tokenizer_errors(self.path, "to decode"):
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        with _tokenizer_errors(self.path, "to name tokens"):
            return [self.tokenizer.id_to_token(i) or "" for i in ids]

    def stream(self, ids: Iterator[int]) -> Iterator[str]:
        """Yield text pieces as tokens arrive. Decoding a short window around the new token (not the whole
        text each time) keeps this O(1) per token; a piece is held back while it ends in a partial character, and
        what is still held when the tokens end comes out as ``decode`` shows it (U+FFFD for the bytes of a character
        that never completed), so the pieces join to the same text as ``decode`` of all the tokens."""
        tokens: list[int] = []
        prefix_offset = read_offset = 0
        prefix_text = new_text = ""
        for token in ids:
            tokens.append(token)
            prefix_text = self.decode(tokens[prefix_offset:read_offset])
            new_text = self.decode(tokens[prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
                yield new_text[len(prefix_text) :]
                prefix_offset, read_offset = read_offset, len(tokens)
        if len(tokens) > read_offset and len(new_text) > len(prefix_text):  # the last token's text, held back
            yield new_text[len(prefix_text) :]
