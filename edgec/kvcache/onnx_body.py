"""A small helper to write ONNX function bodies as straight-line code: each call adds one node, returns names."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper


class Body:
    def __init__(self, prefix: str = "") -> None:
        self.prefix = prefix  # keeps the names of sibling subgraphs (If branches) apart
        self.nodes: list[onnx.NodeProto] = []
        self._names: set[str] = set()
        self._constants: dict[tuple, str] = {}

    def fresh(self, hint: str) -> str:
        hint = self.prefix + hint
        name, count = hint, 0
        while name in self._names:
            count += 1
            name = f"{hint}_{count}"
        self._names.add(name)
        return name

    def op(self, op_type: str, *inputs: str, outputs: int = 1, name: str | None = None, **attributes):
        """Add one node; returns its output name (or a list of names when ``outputs`` > 1)."""
        hint = name or op_type.lower()
        names = [self.fresh(hint if outputs == 1 else f"{hint}_{i}") for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), names, **attributes))
        return names[0] if outputs == 1 else names

    def named(self, op_type: str, inputs: list[str], output: str, **attributes) -> str:
        """A node whose output is a fixed name (a function output)."""
        self._names.add(output)
        self.nodes.append(helper.make_node(op_type, inputs, [output], **attributes))
        return output

    def _constant(self, key: tuple, tensor: onnx.TensorProto) -> str:
        if key not in self._constants:
            self._constants[key] = self.op("Constant", value=tensor, name="const")
        return self._constants[key]

    def i64(self, values: list[int] | int) -> str:
        """An int64 constant: a list gives a 1-D tensor, an int a scalar."""
        dims = [] if isinstance(values, int) else [len(values)]
        data = [values] if isinstance(values, int) else list(values)
        return self._constant(("i64", tuple(dims), tuple(data)), helper.make_tensor("c", TensorProto.INT64, dims, data))

    def f32(self, value: float) -> str:
        return self._constant(("f32", value), helper.make_tensor("c", TensorProto.FLOAT, [], [value]))

    def u8(self, value: int) -> str:
        return self._constant(("u8", value), helper.make_tensor("c", TensorProto.UINT8, [], [value]))

    def boolean(self, value: bool) -> str:
        return self._constant(("bool", value), helper.make_tensor("c", TensorProto.BOOL, [], [value]))

    def shape(self, x: str, axis: int) -> str:
        """The size of one axis as a 1-D int64 tensor of one element."""
        end = {"end": axis + 1} if axis != -1 else {}
        return self.op("Shape", x, start=axis, **end)

    def attribute_ref(self, kind: str, attribute: str, attribute_type: int) -> str:
        """A constant read from the function node's attribute (``scale``, ``window``)."""
        name = self.fresh(f"{attribute}_value")
        node = helper.make_node("Constant", [], [name])
        ref = helper.make_attribute_ref(kind, attribute_type)
        ref.ref_attr_name = attribute
        node.attribute.append(ref)
        self.nodes.append(node)
        return name
