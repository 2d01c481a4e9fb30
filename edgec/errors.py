"""Errors a user can cause. The CLI prints their message on one line and exits non-zero."""


class EdgecError(Exception):
    """Base class: the message says what went wrong and what to do about it."""


class ModelLoadError(EdgecError):
    """The model path, its files or its architecture cannot be used."""


class UnsupportedModelError(ModelLoadError):
    """The architecture is not one edgec can compile."""


class BuildSettingsError(EdgecError):
    """A build option or target is invalid."""


class BundleError(EdgecError):
    """A bundle is missing files, damaged or of an unknown format."""


class SignatureError(BundleError):
    """A bundle or pack checked against trusted keys is unsigned, signed by another key, or changed since it was
    signed; the message names the file."""


class KeyFileError(EdgecError, ValueError):
    """A signing or public key file cannot be used (missing, not Ed25519, encrypted without a passphrase)."""


class GenerationError(EdgecError, ValueError):
    """A runtime call got arguments it cannot honour (e.g. a prompt longer than the context)."""


class StateFileError(EdgecError):
    """A saved cache state (``Model.load_state``, ``edgec run --prefix-cache``) cannot be used: damaged, written for
    another bundle or cache setting, or not a state file."""


class BuildError(EdgecError):
    """A build step could not make what the target needs from this model."""


class ChatTemplateError(EdgecError):
    """A chat template file cannot be read, is not valid Jinja, or does not reduce to the runtime's chat format."""


def one_line(text: object, limit: int = 400) -> str:
    """Text that may hold anything (a file name, a library's message), made safe for a terminal: control
    characters and line breaks escaped, bounded length."""
    text = str(text)[: limit * 2]
    escaped = "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)
    return escaped if len(escaped) <= limit else escaped[: limit - 1] + "…"


def runtime_load_error(path: object, error: BaseException) -> BundleError | None:
    """ONNX Runtime's own exception (InvalidGraph, Fail, ...; not our types) while it loads ``path``, as one line;
    None for any other exception, which the caller re-raises."""
    if not type(error).__module__.startswith("onnxruntime"):
        return None
    return BundleError(f"ONNX Runtime cannot load {path}: {one_line(error)}")
