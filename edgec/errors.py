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


class GenerationError(EdgecError, ValueError):
    """A runtime call got arguments it cannot honour (e.g. a prompt longer than the context)."""


class BuildError(EdgecError):
    """A build step could not make what the target needs from this model."""
