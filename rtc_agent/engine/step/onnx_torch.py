"""An ONNX graph run with torch ops, on whatever device torch has: how the Smart Turn model (smart_turn.py) runs
on the engine's GPU, where onnxruntime would need its own CUDA build (onnxruntime-gpu and cuDNN, about 1 GB that
torch already brings).

The file is the one onnxruntime runs on the CPU, a statically quantized ("QDQ") graph: int8 weights with their
scales, and a QuantizeLinear/DequantizeLinear pair after each activation. Here each pair rounds the activation to
its int8 grid in float32, as the pair defines it, so the result equals onnxruntime's to the rounding of float sums
(tests/test_end_of_turn.py compares the two). Nodes whose inputs are all constants (the weights' dequantization,
shape constants) run once, when the graph is loaded. Integer tensors (shapes and indices) stay on the CPU, so
shape arithmetic never waits for the device.

Only the operators the Smart Turn file uses are implemented; another graph fails to load with the missing names.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

Op = Callable[..., Any]


def _attr(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _broadcast(param: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """A per-axis scale or zero point shaped to broadcast along `axis` of x (one value is per tensor)."""
    if param.numel() == 1:
        return param.reshape(())
    shape = [1] * x.dim()
    shape[axis] = -1
    return param.reshape(shape)


def _quantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, axis: int = 1, **_: Any) -> torch.Tensor:
    """QuantizeLinear, its integers kept in a float tensor; the zero point's type gives their range."""
    info = torch.iinfo(zero.dtype)
    scale, shift = _broadcast(scale, x, axis), _broadcast(zero.to(torch.float32), x, axis)
    return torch.clamp(torch.round(x / scale) + shift, info.min, info.max)


def _dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None = None, axis: int = 1,
                **_: Any) -> torch.Tensor:
    q = q.to(torch.float32)
    shift = 0 if zero is None else _broadcast(zero.to(torch.float32), q, axis)
    return (q - shift) * _broadcast(scale, q, axis)


def _quantize_dequantize(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, axis: int = 1, *,
                         low: float, high: float, **_: Any) -> torch.Tensor:
    """A QuantizeLinear and the DequantizeLinear of its output (same scale and zero point) in four element-wise ops
    instead of six, with the same arithmetic: rounding x / scale, clamping it to the integer range less the zero
    point (`low`, `high`: at load), scaling it back. Adding the zero point before the clamp and taking it off after
    is exact on these integers, so the values are the same (torch.fake_quantize_per_tensor_affine, one op,
    multiplies by 1 / scale, and that moved verdicts against onnxruntime's)."""
    scale = _broadcast(scale, x, axis)
    return torch.div(x, scale).round_().clamp_(low, high).mul_(scale)


def _conv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, *, pads: list[int], strides: list[int],
          dilations: list[int], group: int = 1, **_: Any) -> torch.Tensor:
    if x.dim() != 3 or pads[0] != pads[1]:
        raise NotImplementedError("Conv: only 1-D with symmetric padding")
    return F.conv1d(x, w, b, stride=strides[0], padding=pads[0], dilation=dilations[0], groups=group)


def _gemm(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None = None, *, alpha: float = 1.0,
          beta: float = 1.0, transA: int = 0, transB: int = 0) -> torch.Tensor:
    y = alpha * ((a.T if transA else a) @ (b.T if transB else b))
    return y if c is None else y + beta * c


def _reshape(x: torch.Tensor, shape: torch.Tensor, allowzero: int = 0) -> torch.Tensor:
    dims = shape.tolist()
    if not allowzero:
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    return x.reshape(dims)


def _shape(x: torch.Tensor, start: int = 0, end: int | None = None) -> torch.Tensor:
    return torch.tensor(x.shape[start:end], dtype=torch.int64)


def _slice(x: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, axes: torch.Tensor | None = None,
           steps: torch.Tensor | None = None) -> torch.Tensor:
    index: list[slice] = [slice(None)] * x.dim()
    axes_ = axes.tolist() if axes is not None else list(range(len(starts)))
    steps_ = steps.tolist() if steps is not None else [1] * len(starts)
    for axis, start, end, step in zip(axes_, starts.tolist(), ends.tolist(), steps_):
        if step != 1:
            raise NotImplementedError("Slice: only step 1")
        n = x.shape[axis]
        start, end = (min(max(i + n if i < 0 else i, 0), n) for i in (start, end))  # (ONNX's clamping)
        index[axis] = slice(start, end)
    return x[tuple(index)]


def _reduce_sum(x: torch.Tensor, axes: torch.Tensor | None = None, keepdims: int = 1,
                noop_with_empty_axes: int = 0) -> torch.Tensor:
    if axes is None or axes.numel() == 0:
        return x if noop_with_empty_axes else x.sum().reshape([1] * x.dim() if keepdims else [])
    return x.sum(dim=tuple(axes.tolist()), keepdim=bool(keepdims))


def _gather(x: torch.Tensor, indices: torch.Tensor, axis: int = 0) -> torch.Tensor:
    picked = torch.index_select(x, axis, indices.reshape(-1).to(x.device))
    return picked.reshape(x.shape[:axis] + indices.shape + x.shape[axis + 1:])


def _layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, axis: int = -1,
                epsilon: float = 1e-5, **_: Any) -> torch.Tensor:
    axis = axis % x.dim()
    return F.layer_norm(x, x.shape[axis:], weight, bias, epsilon)


OPS: dict[str, Op] = {
    "QuantizeLinear": _quantize,
    "DequantizeLinear": _dequantize,
    "Add": torch.add,
    "Mul": torch.mul,
    "Div": torch.div,
    "Erf": torch.erf,
    "Tanh": torch.tanh,
    "Sigmoid": torch.sigmoid,
    "MatMul": torch.matmul,
    "Gemm": _gemm,
    "Conv": _conv,
    "LayerNormalization": _layer_norm,
    "Softmax": lambda x, axis=-1: torch.softmax(x, axis),
    "Transpose": lambda x, perm: x.permute(perm),
    "Reshape": _reshape,
    "Shape": _shape,
    "Gather": _gather,
    "Slice": _slice,
    "Concat": lambda *xs, axis: torch.cat(xs, axis),
    "ReduceSum": _reduce_sum,
}


class TorchGraph:
    """An ONNX file's graph, callable with its inputs as tensors (on `device`) and giving its outputs."""

    def __init__(self, path: str | Path, device: torch.device | str = "cpu") -> None:
        import onnx
        from onnx import numpy_helper

        model = onnx.load(str(path))
        missing = sorted({n.op_type for n in model.graph.node} - OPS.keys())
        if missing:
            raise NotImplementedError(f"{path}: operators not implemented here: {', '.join(missing)}")
        self.device = torch.device(device)
        constants = {i.name: self._place(torch.from_numpy(numpy_helper.to_array(i).copy()))
                     for i in model.graph.initializer}
        self.inputs = [i.name for i in model.graph.input if i.name not in constants]
        self.outputs = [o.name for o in model.graph.output]
        self._nodes: list[tuple[Op, list[str], list[str], dict[str, Any]]] = []
        with torch.inference_mode():
            for node in model.graph.node:
                op, attrs = OPS[node.op_type], _attr(node)
                if all(not name or name in constants for name in node.input):  # folded now, once
                    constants.update(zip(node.output, self._outputs(op(*self._args(node.input, constants),
                                                                       **attrs))))
                else:
                    self._nodes.append((op, list(node.input), list(node.output), attrs))
        self._fuse_quantize_dequantize(constants)
        needed = {name for _, inputs, _, _ in self._nodes for name in inputs} | set(self.outputs)
        self._constants = {k: v for k, v in constants.items() if k in needed}
        # Each value is dropped after the last node that reads it: kept to the end, a batch of 32 turns held
        # 10 GB of activations on the GPU instead of a few hundred MB.
        last_use = {name: i for i, (_, inputs, _, _) in enumerate(self._nodes) for name in inputs}
        self._drop = [[name for name in {*inputs, *outputs} if name and last_use.get(name, -1) <= i
                       and name not in self._constants and name not in self.outputs]
                      for i, (_, inputs, outputs, _) in enumerate(self._nodes)]

    def _fuse_quantize_dequantize(self, constants: dict[str, torch.Tensor]) -> None:
        """Each QuantizeLinear whose output only a DequantizeLinear of the same scale and zero point (one per
        tensor) reads becomes one `_quantize_dequantize` node: the activations' pairs, 78 in Smart Turn's file."""
        readers: dict[str, list[int]] = {}
        for i, (_, inputs, _, _) in enumerate(self._nodes):
            for name in inputs:
                readers.setdefault(name, []).append(i)
        nodes, fused_into = [], set()
        for i, (op, inputs, outputs, attrs) in enumerate(self._nodes):
            if i in fused_into:
                continue
            pair = readers.get(outputs[0], []) if op is _quantize and outputs[0] not in self.outputs else []
            zero = constants.get(inputs[2]) if len(inputs) == 3 else None
            if len(pair) == 1 and zero is not None and zero.numel() == 1:
                dequantize, same_inputs, dequantized, _ = self._nodes[pair[0]]
                if dequantize is _dequantize and same_inputs[1:] == inputs[1:]:
                    info, shift = torch.iinfo(zero.dtype), float(zero)
                    nodes.append((_quantize_dequantize, inputs, dequantized,
                                  {**attrs, "low": info.min - shift, "high": info.max - shift}))
                    fused_into.add(pair[0])
                    continue
            nodes.append((op, inputs, outputs, attrs))
        self._nodes = nodes

    def _place(self, tensor: torch.Tensor) -> torch.Tensor:
        """Shapes and indices (int64) stay on the CPU; floats become float32 on the device, and the quantized
        integers go there as they are (a zero point read from the CPU would make each QuantizeLinear wait for the
        device)."""
        if tensor.dtype == torch.int64:
            return tensor
        return tensor.to(self.device, torch.float32 if tensor.is_floating_point() else tensor.dtype)

    @staticmethod
    def _args(names: list[str], values: dict[str, torch.Tensor]) -> list[torch.Tensor | None]:
        return [values[name] if name else None for name in names]

    @staticmethod
    def _outputs(result: Any) -> tuple[torch.Tensor, ...]:
        return result if isinstance(result, tuple) else (result,)

    @torch.inference_mode()
    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        values = dict(self._constants)
        values.update(zip(self.inputs, (self._place(x) for x in inputs)))
        for (op, names, outputs, attrs), drop in zip(self._nodes, self._drop):
            values.update(zip(outputs, self._outputs(op(*self._args(names, values), **attrs))))
            for name in drop:
                del values[name]
        return [values[name] for name in self.outputs]

