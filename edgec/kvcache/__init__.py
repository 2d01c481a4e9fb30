"""The compressed-cache attention op: one meaning (reference.py), its ONNX body (function.py), its torch op."""

from edgec.kvcache.spec import CacheSpec, LayerCache

__all__ = ["CacheSpec", "LayerCache"]
