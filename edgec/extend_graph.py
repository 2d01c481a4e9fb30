"""A third graph for the prompt chunks that only extend the slots: ``extend.onnx``, the prompt-chunk graph
(``prefill.onnx``) with each compressed layer's two choices that such a call always makes the same way taken out
of their ``If``: the attention is the kernel's over the state (not the fallback attention over every slot), and
the chunk's rows go straight into the empty slots after the filled ones (not paired with the weakest slots). The
branches left out are never run by such a call (nor are the per-layer tests that choose them, ~24 nodes each,
which become a constant True), but ONNX Runtime holds every node of both branches in memory
from the moment a session opens (~5 KiB a node): SmolLM2 over 1,024 fp32 slots, 30 layers × 183 nodes. With those
choices made, the layer's third ``If`` — an unobserved call only appends, else the whole call — gives the same
values either way, so the whole call's branch stays alone (``take_judged_branches``: 49 nodes a layer fewer).

A call only extends the slots when every slot up to the filled ones is filled, its positions come after every
cached one and increase, and its tokens fit the slots after them — every chunk of a prompt read from an empty
state (an ``end`` prompt's into its temporary state). The runtime proves that per call
(``OrtCacheState._extends``) and runs the call here; any other multi-token call runs on the general graph, which
the runtime opens the first time one comes (a state continued after its selection or a restore) and then uses for
every call. So ``edgec run``, ``chat`` and ``serve``, which read every prompt from an empty state, never open it
(docs/BENCHMARKS.md, thirty-fifth round of issue 21: the session's memory and its opening time).

Only for the calls' kernel over fp32 slots (``compressed_function._state_kernel``), on compressed layers without a
sliding window, under a policy whose prompt scores need no call's whole score matrix (``prompt_needs`` without
``total``: there an observing call does not take the kernel's output). Not for the hierarchical cache (its
reserved slots) or a mixed-precision one (another body).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgec.errors import BuildError

if TYPE_CHECKING:
    import onnx

    from edgec.kvcache.spec import CacheSpec

EXTEND_FILE = "extend.onnx"


def extend_graph_applies(spec: CacheSpec) -> bool:
    """Whether a bundle of this cache spec gets an extend graph beside its prompt-chunk graph (module docstring)."""
    from edgec.kvcache import policies
    from edgec.kvcache.policies.base import prompt_needs

    compression = spec.compression
    if compression is None or compression.dtype != "fp32" or compression.recall or compression.mixed != "none":
        return False
    if "total" in prompt_needs(policies.get(compression.policy)):
        return False
    return all(layer.window == 0 for layer in spec.layers if layer.compressed)


def write_extend_graph(folder: Path, prefill_file: str, spec: CacheSpec) -> dict[str, Any]:
    """Write ``extend.onnx`` beside ``prefill_file`` (weights stay references into the same data file) where the
    spec allows it (``extend_graph_applies``); returns the manifest's model entry for it ({} if none). Every
    compressed layer must have both choices, or the op's body has changed under this rewrite: a BuildError."""
    import onnx
    import onnx_ir as ir
    import onnx_ir.passes.common

    if not extend_graph_applies(spec):
        return {}
    model = onnx.load(str(folder / prefill_file), load_external_data=False)
    taken = keep_extending_branches(model.graph)
    layers = sum(1 for layer in spec.layers if layer.compressed)
    if taken != 2 * layers:
        raise BuildError(
            f"{prefill_file}: found {taken} of the {2 * layers} extending choices its {layers} compressed layers "
            "should have (compressed_function.EXTEND_CHOICES); the op's body changed"
        )
    judged = take_judged_branches(model.graph)
    if judged != layers:
        raise BuildError(
            f"{prefill_file}: found {judged} of the {layers} choices between appending and the whole call "
            "(compressed_function.APPEND_OR_JUDGE) its compressed layers should have; the op's body changed"
        )
    proven = assume_extending(model.graph)
    if proven != layers:
        raise BuildError(
            f"{prefill_file}: found {proven} of the {layers} tests that a call extends the slots "
            "(compressed_function.EXTENDS_AND_FITS) its compressed layers should have; the op's body changed"
        )
    temporary = folder / f"{EXTEND_FILE}.tmp"
    onnx.save(model, str(temporary))
    del model
    graph = ir.load(temporary)
    onnx_ir.passes.common.RemoveUnusedNodesPass()(graph)  # the choices' conditions and tests, read by nothing now
    ir.save(graph, temporary)
    temporary.replace(folder / EXTEND_FILE)
    return {"extend_file": EXTEND_FILE}


def keep_extending_branches(graph: onnx.GraphProto) -> int:
    """Replace, in ``graph`` and every subgraph, each ``If`` choosing between a pair of
    ``compressed_function.EXTEND_CHOICES`` by its first branch's nodes (its outputs passed on by Identity nodes
    under the If's output names); returns how many."""
    from edgec.kvcache.compressed_function import EXTEND_CHOICES

    return _inline_branches(graph, {pair: "then_branch" for pair in EXTEND_CHOICES})


def take_judged_branches(graph: onnx.GraphProto) -> int:
    """Replace, in ``graph``, each compressed layer's ``If`` between a call that only appends and the whole call
    (``compressed_function.APPEND_OR_JUDGE``, ``_appending``) by the whole call's branch; returns how many.

    Exact for every call the runtime sends here, once ``keep_extending_branches`` has made the whole call's two
    choices: the append branch is taken only for an unobserved call, and there the whole call gives the same
    values. Its output is the kernel's (the same node's); its rows go to the same slots (the direct write); and
    its scores are the slots' own with the new tokens' 0 or +inf (protected) after them. Its one rewrite of
    them, +inf where a filled slot already scores +inf, changes no value. A call the If would send to the whole
    call anyway (it observes, or a filled slot scores -inf or NaN) runs what it ran before. What only the
    append branch and the If's condition read goes (~50 nodes a layer on SmolLM2, with the judging's pairing
    keys left unread by the direct write): ONNX Runtime holds every node of both branches from the moment a
    session opens."""
    from edgec.kvcache.compressed_function import APPEND_OR_JUDGE

    return _inline_branches(graph, {APPEND_OR_JUDGE: "else_branch"}, nested=False)


def _inline_branches(graph: onnx.GraphProto, choices: dict[tuple[str, str], str], nested: bool = True) -> int:
    """Replace each ``If`` whose (then, else) branches' graph names are a key of ``choices`` by the nodes of the
    branch it names (its outputs passed on by Identity nodes under the If's output names), in ``graph`` and, with
    ``nested``, every subgraph (the kept branches' too); returns how many."""
    import onnx
    from onnx import helper

    taken = 0
    nodes = []
    for node in graph.node:
        branches = {attribute.name: attribute.g for attribute in node.attribute}
        choice = None
        if node.op_type == "If":
            choice = choices.get((branches["then_branch"].name, branches["else_branch"].name))
        if choice is not None:
            kept = branches[choice]
            if nested:
                taken += _inline_branches(kept, choices)
            graph.initializer.extend(kept.initializer)
            nodes.extend(kept.node)
            nodes.extend(
                helper.make_node("Identity", [inner.name], [outer], name=f"{outer}_{kept.name}")
                for inner, outer in zip(kept.output, node.output, strict=True)
            )
            taken += 1
            continue
        if nested:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.GRAPH:
                    taken += _inline_branches(attribute.g, choices)
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    return taken


def assume_extending(graph: onnx.GraphProto) -> int:
    """Replace, in ``graph``, each compressed layer's test that the call extends the slots and fits after them
    (``compressed_function.EXTENDS_AND_FITS``, ~24 nodes over the slots' positions and the call's) by a constant
    True: the runtime proves both before it runs a call here (``OrtCacheState._extends``), and the branches kept
    for this graph already hold only what a true test chooses. Returns how many."""
    import onnx
    from onnx import helper

    from edgec.kvcache.compressed_function import EXTENDS_AND_FITS

    true = helper.make_tensor("true", onnx.TensorProto.BOOL, [], [True])
    proven = 0
    for node in graph.node:
        if node.op_type == "And" and EXTENDS_AND_FITS in node.name:
            node.CopyFrom(helper.make_node("Constant", [], list(node.output), name=node.name, value=true))
            proven += 1
    return proven
