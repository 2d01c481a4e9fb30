"""The edgec runtime: load a bundle and generate. Imports numpy, onnxruntime and tokenizers only.

from edgec.runtime import Model
model = Model.load("smol.cpu.edgec")
print(model.generate("The capital of France is", max_new_tokens=16))
"""

from edgec.errors import BundleError, GenerationError, KeyFileError, SignatureError, StateFileError
from edgec.runtime.model import GenerationStats, Model
from edgec.runtime.prefix_cache import SavedPrompt

__all__ = [
    "BundleError",
    "GenerationError",
    "GenerationStats",
    "KeyFileError",
    "Model",
    "SavedPrompt",
    "SignatureError",
    "StateFileError",
]
