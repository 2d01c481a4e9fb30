"""What a pass needs from the graph it is given and what it leaves: the rules that order a pipeline.

Each pass file declares ``PASS = Pass(...)`` next to its function. ``edgec.pipeline`` chooses the passes of a
build from a table and checks, before anything runs, that every pass finds the properties it requires (so an
order that would silently produce a wrong graph is refused) and that the finished graph is one the target's
runtime can execute.

Properties of a graph (the exporter's output has all of ``EXPORTED``):
  fp32                 float tensors are float32 (quantizing passes read fp32 weights)
  matmul_weights       every constant-weight projection is a MatMul (none yet a Gemm)
  kv_attention         attention is ``ai.edgec::KVAttention`` with its default (dynamic-shape) body
  global_kv_attention  every global layer's attention is still a KVAttention node (none lowered or compressed)
  local_functions      the graph holds model-local functions (KVAttention's body)
  opset23_ops          it uses ops new in ONNX opset 23 (RMSNormalization, RotaryEmbedding)
Properties a pass may add: fp16, quantized_weights, compressed_attention, static_attention.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

EXPORTED = frozenset(
    {"fp32", "matmul_weights", "kv_attention", "global_kv_attention", "local_functions", "opset23_ops"}
)


@dataclass(frozen=True)
class Pass:
    """A graph pass: ``run(model, **options) -> int`` (how many places changed), or with ``cache=True``
    ``run(model, spec, **options) -> (int, CacheSpec)`` for a pass that changes the cache state it carries."""

    name: str
    run: Callable
    requires: frozenset[str] = frozenset()  # properties the graph must have
    ensures: frozenset[str] = frozenset()  # properties it has afterwards
    removes: frozenset[str] = frozenset()  # properties it no longer has afterwards
    domains: tuple[str, ...] = ()  # non-standard op domains the pass may add (the runtime must execute them)
    cache: bool = False

    def after(self, properties: frozenset[str]) -> frozenset[str]:
        return (properties - self.removes) | self.ensures
