"""torch model → ONNX IR of one decode/prefill *step*, with one ``ai.edgec::KVAttention`` node per layer.

The step: (input_ids [B,T], position_ids [B,T], logits_index [N], cache state) → (logits [B,N,V], new
cache state). ``logits_index`` picks the positions whose logits are computed, so generation pays for the
lm_head on one position while scoring (``Model.logprobs``) asks for all of them.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir
import torch

from edgec.kvcache import CacheSpec, LayerCache, torch_op
from edgec.kvcache import function as kv_function
from edgec.shape import ModelShape

OPSET = 23


@dataclass(frozen=True)
class StepIO:
    """Graph input/output names of the step, in order."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


def cache_spec_for(config, capacity: int, prefill_chunk: int | None = None) -> CacheSpec:
    """The cache a model (its config or ``ModelShape``) is exported with. Slots per layer: global layers get
    ``capacity``. A sliding-window layer needs only its window plus one prefill chunk: with slot = position mod
    capacity the slots form a ring, and a chunk of at most ``prefill_chunk`` tokens overwrites only positions that
    no query of that chunk can see (exact). The runtime never feeds a chunk longer than the build's
    ``prefill_chunk``."""
    shape = config if isinstance(config, ModelShape) else ModelShape.from_config(config)

    def slots(window: int) -> int:
        return min(capacity, window + prefill_chunk) if window and prefill_chunk else capacity

    return CacheSpec(
        layers=tuple(
            LayerCache(
                layer=i, num_kv_heads=shape.kv_heads, head_dim=shape.head_dim, capacity=slots(window), window=window
            )
            for i, window in enumerate(shape.layer_windows())
        )
    )


class StepModule(torch.nn.Module):
    """Wraps a ``*ForCausalLM`` into the step function that is traced."""

    def __init__(self, causal_lm: torch.nn.Module, spec: CacheSpec) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        self.windows = [layer.window for layer in spec.layers]
        # Gemma 2/3 squash logits as cap * tanh(logits / cap) in the *ForCausalLM forward, which the step skips
        self.final_softcap = getattr(causal_lm.config, "final_logit_softcapping", None)

    def forward(self, input_ids, position_ids, logits_index, *caches):
        router = torch_op.CacheRouter(caches, self.windows)
        hidden = self.causal_lm.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, edgec_cache=router
        ).last_hidden_state
        logits = self.causal_lm.lm_head(hidden.index_select(1, logits_index))
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return (logits.float(), *router.flat_new())


def empty_cache(spec: CacheSpec, batch: int = 1, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    tensors = []
    for layer in spec.layers:
        shape = (batch, layer.num_kv_heads, layer.capacity, layer.head_dim)
        tensors += [torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)]
        tensors.append(torch.full(shape[:3], -1, dtype=torch.int64))
    return tensors


def step_io(spec: CacheSpec) -> StepIO:
    inputs = ["input_ids", "position_ids", "logits_index"]
    outputs = ["logits"]
    for tensor in spec.tensors():
        inputs.append(tensor.input)
        outputs.append(tensor.output)
    return StepIO(tuple(inputs), tuple(outputs))


@contextlib.contextmanager
def kv_attention_routed(causal_lm: torch.nn.Module):
    """Route the model's attention through KVAttention for the duration, then restore it (a model's sub-configs
    are separate objects, each with its own switch)."""
    name = torch_op.register_attention()
    configs = {id(c): c for c in [causal_lm.config, *(getattr(m, "config", None) for m in causal_lm.modules())] if c}
    previous = {key: config._attn_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._attn_implementation = name
        yield causal_lm.eval()
    finally:
        for key, config in configs.items():
            config._attn_implementation = previous[key]


@contextlib.contextmanager
def layers_reported(causal_lm: torch.nn.Module, report: Callable[[int, int], None] | None):
    """``report(done, total)`` as the trace passes each decoder layer: forward hooks run as plain Python during a
    non-strict torch.export, outside what is recorded, so they cost nothing in the graph."""
    layers = getattr(getattr(causal_lm, "model", None), "layers", None)
    if report is None or layers is None:
        yield
        return
    total = len(layers)
    handles = [
        layer.register_forward_hook(lambda *_, done=done: report(done, total)) for done, layer in enumerate(layers, 1)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def export_step(
    causal_lm: torch.nn.Module, spec: CacheSpec, report: Callable[[str, int, int], None] | None = None
) -> ir.Model:
    """Trace the step function and return the ONNX IR model with the KVAttention function attached.
    ``report(step, done, total)``: "trace layers" once per decoder layer, then "to onnx" 0/1 … 1/1 around the
    translation (torch's exporter gives no finer steps)."""
    report = report or (lambda step, done, total: None)
    step = StepModule(causal_lm, spec).eval()
    io = step_io(spec)
    example_len = 3
    args = (
        torch.zeros((1, example_len), dtype=torch.int64),
        torch.arange(example_len, dtype=torch.int64)[None],
        torch.arange(example_len, dtype=torch.int64),
        *empty_cache(spec),
    )
    seq = torch.export.Dim("seq", min=1, max=max(spec.capacity, 2))
    n_logits = torch.export.Dim("n_logits", min=1, max=max(spec.capacity, 2))
    dynamic_shapes = {
        "input_ids": {1: seq},
        "position_ids": {1: seq},
        "logits_index": {0: n_logits},
        "caches": tuple([None] * len(spec.layers) * 3),
    }
    with torch.no_grad(), warnings.catch_warnings(), kv_attention_routed(causal_lm):
        warnings.simplefilter("ignore")
        logging.getLogger("torch.onnx").setLevel(logging.ERROR)
        # torch.onnx.export rewrites a tuple of dynamic shapes into a list that torch.export then rejects for
        # *caches, so the program is exported first and handed over.
        with layers_reported(causal_lm, lambda done, total: report("trace layers", done, total)):
            exported = torch.export.export(step, args, dynamic_shapes=dynamic_shapes, strict=False)
        report("to onnx", 0, 1)
        program = torch.onnx.export(
            exported,
            dynamo=True,
            input_names=list(io.inputs),
            output_names=list(io.outputs),
            opset_version=OPSET,
            custom_translation_table=torch_op.ONNX_TRANSLATIONS,
            optimize=True,
            verbose=False,
        )
    model = program.model
    drop_source_locations(model)
    attach_kv_function(model)
    report("to onnx", 1, 1)
    return model


def drop_source_locations(model: ir.Model) -> None:
    """Remove the exporter's per-node stack traces: they hold the build machine's file paths and the line numbers
    of edgec's and transformers' sources, so two checkouts of the same release built different bundles from the
    same inputs (and a bundle told where it was built)."""
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        node.metadata_props.pop("pkg.torch.onnx.stack_trace", None)


def attach_kv_function(model: ir.Model) -> None:
    """Give the model the KVAttention function body (the exporter inlines functions, so it is added after)."""
    default_opset = model.opset_imports.get("", OPSET)
    function_proto = kv_function.make_function(default_opset)
    ir_function = ir.serde.deserialize_function(function_proto)
    model.functions[ir_function.identifier()] = ir_function
    model.opset_imports[kv_function.DOMAIN] = kv_function.OPSET_VERSION
