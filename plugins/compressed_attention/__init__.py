"""``ai.edgec::CompressedKVAttention``'s one-token decode step: a Triton kernel (kernel.py), the ONNX sub-op that
carries it (graph.py) and its TensorRT-RTX plugin (plugin.py, copied into a bundle). See docs/plugins.md."""
