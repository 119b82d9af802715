"""Tracing a model for the planner: its input shapes, a meta-device build, and ONE forward on
meta tensors (no memory, no arithmetic) that records every call of a module the converter would
replace, with its input and output shapes, every leaf module's output shape, the tensors autograd
saves for backward and the convolutions' column buffers (for the memory estimate).

Which modules are replaced, and by what, is the converter's own plan
(``domain.convert.plan_conversion``, ``domain/plan.py``: CREDIT-model adapters such as FuXi,
attention, the rule walk, ``nonlocal_policy`` = ``trainer.domain_nonlocal_policy`` wrapping what
"raise" refuses, and the exchange fusions), so the planner sees exactly the layers a run would
build.
Input shapes of the known model types (assumptions, read from the built model's attributes,
which mirror the ``model:`` config keys):

* ``unet``, ``crossformer``: one input ``(B, in_channels, image_height, image_width)``;
* ``pangu``: ``upper (B, upper_channels, levels, image_height, image_width)`` and
  ``surface (B, surface_channels, image_height, image_width)``;
* any other model may define ``input_shapes`` (a list of per-sample shapes WITHOUT the batch
  dim, or a method returning one); a model with ``in_channels``/``image_height``/
  ``image_width`` attributes is taken to have one B,C,H,W input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..domain.convert import plan_conversion
from ..domain.plan import ConversionPlan
from ..models import build_model

__all__ = [
    "Trace",
    "build_meta_model",
    "conversion_plan",
    "domain_targets",
    "model_input_shapes",
    "plan_relayouts",
    "plan_targets",
    "trace_model",
]

SHARD_DIM = -2  # latitude, as convert_to_domain_parallel shards it by default


def model_input_shapes(model: nn.Module) -> tuple[tuple[int, ...], ...]:
    """Per-sample input shapes (no batch dim) of a model, by the rules in the module docstring."""
    declared = getattr(model, "input_shapes", None)
    if declared is not None:
        shapes = declared() if callable(declared) else declared
        return tuple(tuple(int(v) for v in s) for s in shapes)
    attrs = {
        k: getattr(model, k, None)
        for k in (
            "in_channels",
            "upper_channels",
            "surface_channels",
            "levels",
            "image_height",
            "image_width",
        )
    }
    h, w = attrs["image_height"], attrs["image_width"]
    if all(isinstance(attrs[k], int) for k in ("upper_channels", "surface_channels", "levels")):
        return (
            (attrs["upper_channels"], attrs["levels"], h, w),
            (attrs["surface_channels"], h, w),
        )
    if all(isinstance(v, int) for v in (attrs["in_channels"], h, w)):
        return ((attrs["in_channels"], h, w),)
    raise ValueError(
        f"cannot tell the input shape of {type(model).__name__}: give it an `input_shapes` "
        "attribute (per-sample shapes without the batch dim) or in_channels/image_height/"
        "image_width attributes"
    )


def build_meta_model(conf: dict) -> tuple[nn.Module, str]:
    """The model of ``conf["model"]`` built on the meta device, and its type name."""
    conf_model = conf.get("model")
    if not isinstance(conf_model, dict):
        raise ValueError(
            "config is missing the 'model' section (e.g. {type: unet, in_channels: 8, ...})"
        )
    with torch.device("meta"):
        model = build_model(conf_model)
    return model, str(conf_model.get("type"))


def conversion_plan(
    model: nn.Module, nonlocal_policy: str = "raise", halo_chains=False
) -> ConversionPlan:
    """The converter's own plan for ``model`` (``domain.convert.plan_conversion``, no custom
    converters, manager None: the layers need one only when they run), modules it cannot
    convert listed rather than raised.  The root model itself cannot be replaced by an
    attention layer here (the tracer hooks the modules of the plain model in place)."""
    plan = plan_conversion(
        model,
        None,
        SHARD_DIM,
        nonlocal_policy=nonlocal_policy,
        errors="record",
        halo_chains=halo_chains,
    )
    if any(m.path == "<root>" and m.stage == "attention" for m in plan.modules):
        raise ValueError("the planner cannot plan a model whose root is itself an attention module")
    return plan


def plan_targets(plan: ConversionPlan) -> list:
    """``(path, module, replacement or error)`` of every module of ``plan`` whose calls the
    tracer records, in the converter's order.  A CREDIT-model adapter that is not itself a
    domain layer (``DomainFuxi``: its layers are planned one by one) is left out, except one
    whose ``padding_calls`` the tracer records (``DomainPaddedModel``: CREDIT's
    ``TensorPadding`` in the model's forward)."""
    return [
        (m.path, m.original, m.replacement if m.error is None else m.error)
        for m in plan.modules
        if m.error is not None
        or m.stage != "adapter"
        or getattr(m.replacement, "_domain_parallel", False)
        or hasattr(m.replacement, "padding_calls")
    ]


def plan_relayouts(plan: ConversionPlan) -> list:
    """``(path, module, replacement)`` of the CREDIT-model adapters of ``plan`` that are not
    domain layers and not exact on tiles (``DomainFuxi``): on lat x lon tiles the converter
    runs each one whole on latitude strips (``tiles_convert.relayout_on_tiles``), so the tile
    plan needs their calls (``Trace.relayouts``)."""
    return [
        (m.path, m.original, m.replacement)
        for m in plan.modules
        if m.error is None
        and m.stage == "adapter"
        and not getattr(m.replacement, "_domain_parallel", False)
        and not getattr(m.replacement, "tile_exact", False)
    ]


def domain_targets(model: nn.Module, nonlocal_policy: str = "raise"):
    """``(targets, unsafe)`` of :func:`conversion_plan`: :func:`plan_targets` and the modules
    the converter refuses (empty under ``nonlocal_policy="gather"``: they are wrapped in
    :class:`~credit_parallel.domain.layers.gather.DomainGatherModule`)."""
    plan = conversion_plan(model, nonlocal_policy)
    return plan_targets(plan), list(plan.unsafe)


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


_SHAPE_PRESERVING = (nn.GroupNorm, nn.LayerNorm)
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _saves_its_input(one: torch.Tensor):
    """A stand-in for a normalisation on meta: a new output of the input's shape that saves the
    input for backward, as the real normalisation does (``x * one``, ``one`` requiring grad)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return x * one

    return forward


@dataclass
class Trace:
    calls: list  # (path, module, replacement, in_shape, out_shape, input tensor)
    leaf_outputs: list  # (path, out_shape)
    model_outputs: list  # shapes
    # what autograd saves for backward, one entry per distinct storage (parameters and model
    # inputs excluded): (shape, bytes) at batch 1
    saved: list = field(default_factory=list)
    # per convolution call, its im2col buffer at batch 1 (elements): C_in/groups x kernel x
    # output positions, the column matrix PyTorch's CPU convolution builds (cost.py
    # conv_workspace_bytes: what a GPU allocates instead)
    conv_columns: list = field(default_factory=list)
    # calls of the ``relayouts`` given to :func:`trace_model` (adapters run whole on strips on
    # tiles): (path, module, replacement, in_shape, out_shape, input needs a gradient, output
    # needs a gradient)
    relayouts: list = field(default_factory=list)
    # per call of ``calls``: whether its output needs a gradient (False: no backward at all,
    # e.g. a padding of the model's input)
    output_grads: list = field(default_factory=list)


def _conv_columns(mod, args, out) -> int:
    """Elements of the im2col columns PyTorch's CPU convolution allocates for one sample
    (``aten/src/ATen/native/ConvolutionMM2d.cpp`` ``compute_columns2d``: ``(batch,
    C_in * kh * kw, out_h * out_w)``; a 1x1 kernel of stride 1 without padding uses a view of
    the input, no buffer (a string padding of a 1x1 kernel is 0); a grouped convolution runs group by group, ``C_in / groups``)."""
    x = next(_tensors(args), None)
    if x is None or not isinstance(out, torch.Tensor):
        return 0
    groups = max(1, int(getattr(mod, "groups", 1)))
    if isinstance(mod, (nn.ConvTranspose2d, nn.ConvTranspose3d)):  # columns of the input
        return mod.out_channels // groups * math.prod(mod.kernel_size) * math.prod(x.shape[2:])
    pointwise = (
        all(k == 1 for k in mod.kernel_size)
        and all(s == 1 for s in mod.stride)
        and (isinstance(mod.padding, str) or all(p == 0 for p in mod.padding))
    )
    if pointwise:
        return 0
    return mod.in_channels // groups * math.prod(mod.kernel_size) * math.prod(out.shape[2:])


class _RecordedPadding:
    """Stands in for a model's ``padding_opt`` (CREDIT's ``TensorPadding``) during the meta
    forward: runs it and records the ``pad`` / ``unpad`` calls with their geometry."""

    def __init__(self, path, original, geometry, calls, output_grads):
        self.path, self.original, self.geometry, self.calls = path, original, geometry, calls
        self.output_grads = output_grads

    def _call(self, name: str, which: int, x):
        y = getattr(self.original, name)(x)
        geometry = self.geometry[which]
        where = f"{self.path}.padding_opt.{name}" if self.path else f"padding_opt.{name}"
        self.calls.append((where, geometry, geometry, tuple(x.shape), tuple(y.shape), x))
        self.output_grads.append(y.requires_grad)
        return y

    def pad(self, x):
        return self._call("pad", 0, x)

    def unpad(self, x):
        return self._call("unpad", 1, x)


def _record_padding(path, module, replacement, calls, output_grads):
    """Swap ``module.padding_opt`` for a :class:`_RecordedPadding`; ``(module, original)``."""
    original = module.padding_opt
    module.padding_opt = _RecordedPadding(
        "" if path == "<root>" else path, original, replacement.padding_calls(), calls,
        output_grads,
    )  # fmt: skip
    return module, original


def trace_model(model: nn.Module, input_shapes, targets, relayouts=()) -> Trace:
    """One forward on meta tensors (batch 1, autograd on) recording domain-layer calls, leaf
    outputs, the tensors autograd saves and convolution column buffers; and the calls of
    ``relayouts`` (:func:`plan_relayouts`)."""
    calls, leaf_outputs, handles, conv_columns, relayout_calls = [], [], [], [], []
    output_grads: list = []
    dtype = next((p.dtype for p in model.parameters()), torch.get_default_dtype())
    by_module = {}
    for path, module, replacement in targets:
        by_module.setdefault(id(module), (path, module, replacement))
    inputs = [torch.empty((1, *s), device="meta", dtype=dtype) for s in input_shapes]
    excluded = {t.untyped_storage()._cdata for t in (*model.parameters(), *inputs)}
    saved: dict[int, tuple] = {}

    def pack(t: torch.Tensor):
        key = t.untyped_storage()._cdata
        if key not in excluded:
            saved.setdefault(key, (tuple(t.shape), t.untyped_storage().nbytes()))
        return t

    swapped = []
    try:
        for path, module, replacement in list(by_module.values()):
            if hasattr(replacement, "padding_calls"):
                swapped.append(_record_padding(path, module, replacement, calls, output_grads))
                del by_module[id(module)]
        for path, module, replacement in relayouts:

            def whole(mod, args, out, path=path, replacement=replacement):
                ins, outs = list(_tensors(args)), list(_tensors(out))
                if ins and outs:
                    shapes = (tuple(ins[0].shape), tuple(outs[0].shape))
                    grads = (ins[0].requires_grad, outs[0].requires_grad)
                    relayout_calls.append((path, mod, replacement, *shapes, *grads))

            handles.append(module.register_forward_hook(whole))
        for path, module, replacement in by_module.values():

            def record(mod, args, out, path=path, replacement=replacement):
                ins = list(_tensors(args))
                outs = list(_tensors(out))
                if ins and outs:
                    # the input itself too: sibling layers called on one tensor share an exchange
                    calls.append(
                        (path, mod, replacement, tuple(ins[0].shape), tuple(outs[0].shape), ins[0])
                    )
                    output_grads.append(outs[0].requires_grad)

            handles.append(module.register_forward_hook(record))
        for path, module in model.named_modules():
            if next(module.children(), None) is not None:
                continue

            def leaf(mod, args, out, path=path):
                for t in _tensors(out):
                    leaf_outputs.append((path or "<root>", tuple(t.shape)))
                if isinstance(mod, _CONVS):
                    conv_columns.append(_conv_columns(mod, args, out))

            handles.append(module.register_forward_hook(leaf))
        one = torch.ones((), device="meta", dtype=dtype, requires_grad=True)
        for module in model.modules():
            # Normalisations keep the shape; on meta tensors their reference decompositions cost
            # seconds of imports for nothing, so the (private, meta) copy runs a stand-in that
            # saves what they save (their input) and makes a new output.
            if type(module) in _SHAPE_PRESERVING:
                module.forward = _saves_its_input(one)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
    except Exception as err:  # a forward that cannot run on meta tensors: unusable for planning
        raise ValueError(
            f"could not trace {type(model).__name__} on the meta device with inputs "
            f"{[(1, *s) for s in input_shapes]}: {type(err).__name__}: {err}"
        ) from err
    finally:
        for h in handles:
            h.remove()
        for module, original in swapped:
            module.padding_opt = original
    saved.pop(one.untyped_storage()._cdata, None)
    return Trace(
        calls,
        leaf_outputs,
        [tuple(t.shape) for t in _tensors(out)],
        list(saved.values()),
        conv_columns,
        relayout_calls,
        output_grads,
    )
