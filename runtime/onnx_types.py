"""The types of a model's values, as the runtime's rewrites and its cut read them (one place)."""

from __future__ import annotations

import onnx
from onnx import helper


def with_inferred_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with onnx's inferred value_info added; ``model`` itself where inference cannot take
    it (e.g. over 2 GB): the written value_info must then carry the types. Nodes of an unknown
    domain (collectives) are skipped; their outputs are typed by contract."""
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - any failure leaves the written types
        return model


def value_types(graph: onnx.GraphProto) -> dict[str, onnx.TypeProto]:
    """Name -> type of every value ``graph`` types: initializers, then value_info, inputs, outputs."""
    types = {t.name: helper.make_tensor_type_proto(t.data_type, list(t.dims)) for t in graph.initializer}
    for vi in (*graph.value_info, *graph.input, *graph.output):
        if vi.type.WhichOneof("value") is not None:
            types[vi.name] = vi.type
    return types
