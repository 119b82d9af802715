"""Replicated tensors that meet tp-sharded activations: found by tracing, made exact.

Megatron's column layer all-reduces its input gradient over tp ("f"), so a replicated tensor
that enters the tp region THROUGH a column layer gets its whole gradient on every tp rank.  A
replicated tensor that meets the sharded activations any other way — CREDIT's dynamic position
bias ``dpb(rel_pos)`` added to the local heads' attention scores — receives on each tp rank only
the gradient of that rank's heads: its parameters train on a fraction of their gradient (and the
tp ranks drift apart).  Nothing in a ``_tp_col``/``_tp_plan`` declaration says where that
happens, so it is found, not declared:

:class:`TensorParallelTrace` is a ``TorchFunctionMode`` active during one forward.  Column
outputs are marked *sharded*; every tensor computed from a sharded one is sharded; a row output
is replicated again.  Replicated tensors carry *labels*: the module paths (and parameters) they
were computed from through replicated ops only.  A replicated tensor combined with a sharded one
makes its labels *partial*; one that reaches the model's output or a column layer's input makes
them *full*.  A module output that is partial and never full has a gradient that is exactly the
sum over tp of the per-rank gradients, so Megatron's "f" on that output (identity forward,
all-reduce of the gradient in backward) makes it, and everything computed before it, exact.

:func:`install_partial_gradient_guard` (called by ``apply_tensor_parallel`` before it converts)
traces the first forward of the converted model, puts "f" on the gradient of the tensors it found
in that forward and on the output of their modules in every later one.  Under ``torch.compile``
of the whole model (no eager call first) the trace cannot run inside the graph: the structure it
finds does not depend on the values, so it runs at trace time (``assume_constant_result``,
outside the graph, as the domain height probe does) on a meta twin of the model taken before the
tp conversion, on meta inputs of the global input shapes, and "f" is a forward hook on those
modules' outputs from the first forward on; its backward all-reduce is traced as a functional
collective.  A replicated parameter used directly on
sharded activations (not through a submodule), or a module output whose gradient is partly
partial and partly full, cannot be made exact this way: that raises, naming the path and the fix.
:func:`find_partial_gradient_modules` runs the same trace on an unconverted model in one process
(no process group; the column targets named by path), for ``plan`` and tests.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from ..domain.traced_heights import describe_input, global_inputs, shape_twin

__all__ = [
    "CopyToTensorParallel",
    "PartialGradientReport",
    "ReduceFromTensorParallel",
    "TensorParallelTrace",
    "find_partial_gradient_modules",
    "install_partial_gradient_guard",
]

SHARDED = "sharded"


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's "f": identity forward; backward all-reduces the gradient over ``group`` (each
    tp rank holds only the contribution of its own features or heads)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's "g": forward all-reduces the partial sums of a row layer; backward is the
    identity (the output gradient is already replicated)."""

    @staticmethod
    def forward(ctx, x, group):
        total = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@dataclass
class PartialGradientReport:
    """What one traced forward found.

    ``modules``: paths of the module outputs that get "f" (partial gradient, never full, not
    inside another such output).  ``parameters``: the replicated parameters those cover.
    ``unfixable``: ``(path, reason)`` for partial tensors "f" cannot make exact."""

    modules: list[str] = field(default_factory=list)
    parameters: list[str] = field(default_factory=list)
    unfixable: list[tuple[str, str]] = field(default_factory=list)


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


class TensorParallelTrace(TorchFunctionMode):
    """Marks tensors sharded / replicated-with-labels during one forward (see the module doc).

    ``column`` / ``row``: the module paths of the tp targets; their internals are not traced.
    Hooks are registered by :meth:`attach` and removed by :meth:`detach`."""

    def __init__(self, model: nn.Module, column: set[str], row: set[str]):
        super().__init__()
        self.model = model
        self.column, self.row = set(column), set(row)
        # id(tensor) -> (weak reference, SHARDED or a frozenset of labels); the reference tells
        # a live tensor from a new one that reuses a freed tensor's id
        self.state: dict[int, tuple] = {}
        self.partial: set[str] = set()
        self.full: set[str] = set()
        self.covers: dict[str, frozenset] = {}  # module path -> labels of its output
        self.outputs: dict[str, list[torch.Tensor]] = {}  # module path -> its output tensors
        self.param_names = {
            id(p): n for n, p in model.named_parameters() if type(p) is nn.Parameter
        }
        self.depth = 0  # > 0 inside a tp target
        self.handles: list = []

    # ---- marks
    def _mark(self, t: torch.Tensor, value) -> None:
        self.state[id(t)] = (weakref.ref(t), value)

    def _labels(self, t: torch.Tensor):
        ref, value = self.state.get(id(t), (None, None))
        if ref is not None and ref() is t:
            return value
        if id(t) in self.param_names:
            return frozenset({"parameter " + self.param_names[id(t)]})
        return frozenset()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.depth == 0:
            inputs = _tensors((args, kwargs))
            marks = [self._labels(t) for t in inputs]
            if any(m is SHARDED for m in marks):
                for m in marks:
                    if m is not SHARDED:
                        self.partial.update(m)
                for t in _tensors(out):
                    self._mark(t, SHARDED)
            else:
                labels = frozenset().union(*marks) if marks else frozenset()
                for t in _tensors(out):
                    self._mark(t, labels)
        return out

    # ---- module hooks
    def attach(self) -> None:
        for path, module in self.model.named_modules():
            if path in self.column or path in self.row:
                # first and last: the tp styles' own hooks redistribute inputs and outputs
                self.handles.append(
                    module.register_forward_pre_hook(self._enter_target(path), prepend=True)
                )
                self.handles.append(
                    module.register_forward_hook(self._leave_target(path), always_call=True)
                )
            elif path:
                self.handles.append(module.register_forward_hook(self._module_output(path)))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _enter_target(self, path):
        def hook(module, args):
            if self.depth == 0 and path in self.column:
                for t in _tensors(args):  # enters through "f": a full gradient
                    labels = self._labels(t)
                    if labels is not SHARDED:
                        self.full.update(labels)
            self.depth += 1

        return hook

    def _leave_target(self, path):
        def hook(module, args, output):
            self.depth -= 1
            if self.depth == 0:
                mark = SHARDED if path in self.column else frozenset()
                for t in _tensors(output):
                    self._mark(t, mark)

        return hook

    def _module_output(self, path):
        def hook(module, args, output):
            if self.depth:
                return
            for t in _tensors(output):
                labels = self._labels(t)
                if labels is SHARDED:
                    continue
                self._mark(t, labels | {path})
                self.covers[path] = self.covers.get(path, frozenset()) | labels
                self.outputs.setdefault(path, []).append(t)

        return hook

    def finish(self, output) -> PartialGradientReport:
        """Mark the model's output full and decide (see the module doc)."""
        for t in _tensors(output):
            labels = self._labels(t)
            if labels is not SHARDED:
                self.full.update(labels)
        only_partial = self.partial - self.full
        candidates = [p for p in self.outputs if p in only_partial]
        modules = [p for p in candidates if not any(p in self.covers[q] for q in candidates)]
        covered = set(modules).union(*(self.covers[p] for p in modules))
        report = PartialGradientReport(modules=modules)
        report.parameters = sorted(
            label.removeprefix("parameter ") for label in covered if label.startswith("parameter ")
        )
        for label in sorted(self.partial - covered):
            if label in self.full:
                why = (
                    "its gradient is partly the local heads' share (it meets tp-sharded "
                    "activations) and partly whole (it also reaches the output replicated)"
                )
            elif label.startswith("parameter "):
                why = (
                    "it is used directly on tp-sharded activations; compute it in a submodule "
                    "(whose output then gets the all-reduce) or shard it with the heads"
                )
            else:
                continue  # inside a module output that gets "f"
            report.unfixable.append((label, why))
        return report


def _unfixable_error(report: PartialGradientReport) -> ValueError:
    lines = "; ".join(f"{path}: {why}" for path, why in report.unfixable)
    return ValueError(
        "tensor parallelism cannot make these replicated tensors' gradients exact (each tp "
        f"rank would hold only its heads' share): {lines}; or set trainer.parallelism.tensor: 1"
    )


def find_partial_gradient_modules(
    model: nn.Module, column: set[str], row: set[str], *inputs, **kwargs
) -> PartialGradientReport:
    """Trace ``model(*inputs, **kwargs)`` in one process (no communication; unconverted model,
    any device including meta) with ``column`` / ``row`` the tp target paths."""
    trace = TensorParallelTrace(model, column, row)
    trace.attach()
    try:
        with trace:
            output = model(*inputs, **kwargs)
    finally:
        trace.detach()
    return trace.finish(output)


def install_partial_gradient_guard(
    model: nn.Module, column: set[str], row: set[str], group
) -> PartialGradientGuard:
    """Make the partial gradients of the converted ``model`` exact over ``group`` (the tp
    process group).  Call it BEFORE the tp conversion: it keeps a meta twin of the model.

    Eagerly, the first forward is traced (``torch.compiler`` stance ``force_eager``: blocks
    compiled by ``compile_blocks`` run eagerly while traced); the gradients of the tensors it
    finds are all-reduced in that forward and the outputs of their modules get "f" in every
    later one.  When Dynamo traces the model first (``torch.compile`` of the whole model), the
    same trace runs at trace time on the meta twin (:class:`PartialGradientGuard`), outside the
    graph, and "f" is on those outputs from the first forward on."""
    guard = PartialGradientGuard(model, column, row, group)
    state = {}

    def before(module, args, kwargs):
        if torch.compiler.is_compiling():
            manager = getattr(model, "_domain_manager", None)
            token = manager._token if manager is not None else None
            described = tuple(describe_input(a) for a in args)
            named = tuple((k, describe_input(v)) for k, v in kwargs.items())
            _detect_at_trace(guard, token, described, named)
            return
        if guard.report is not None:
            return
        trace = TensorParallelTrace(model, column, row)
        trace.attach()
        trace.__enter__()
        state["trace"] = trace
        state["stance"] = _set_stance("force_eager")

    def after(module, args, kwargs, output):
        if torch.compiler.is_compiling():
            return None
        trace = state.pop("trace", None)
        if trace is None:
            return None
        trace.__exit__(None, None, None)
        trace.detach()
        _set_stance(state.pop("stance"))
        report = trace.finish(output)
        if not report.unfixable:
            for path in report.modules:
                for t in trace.outputs[path]:
                    if t.requires_grad:
                        t.register_hook(_all_reduce_hook(group))
        guard.install(report)
        return None

    model.register_forward_pre_hook(before, with_kwargs=True)
    model.register_forward_hook(after, with_kwargs=True, always_call=True)
    return guard


class PartialGradientGuard:
    """What :func:`install_partial_gradient_guard` keeps: the tp targets, the group, a meta twin
    of the model taken before the tp conversion (every parameter and buffer on the meta device;
    domain layers run their original module, ``traced_heights``) and, once found, the report."""

    def __init__(self, model: nn.Module, column: set[str], row: set[str], group):
        self.model = weakref.ref(model)
        self.column, self.row, self.group = set(column), set(row), group
        self.report: PartialGradientReport | None = None
        self.twin, self.why = None, None
        try:
            self.twin = shape_twin(model, _NoHeights())
        except Exception as e:  # an un-copyable model: eager forwards still work
            self.why = f"{type(e).__name__}: {e}"

    def detect(self, token, args, kwargs) -> None:
        """At trace time: run the trace on the twin, on meta inputs of the GLOBAL shapes of the
        inputs described by ``args`` / ``kwargs`` (``traced_heights.describe_input``), and install."""
        if self.report is not None:
            return
        model = self.model()
        name = type(model).__name__
        if self.twin is None:
            raise RuntimeError(
                f"torch.compile of the whole tensor-parallel {name}: no meta twin to find the "
                f"partial gradients on ({self.why}); set trainer.compile: true (per-block "
                "compile_blocks) instead"
            )
        manager = getattr(model, "_domain_manager", None)
        meta_args, meta_kwargs = global_inputs(manager, token, args, kwargs)
        with torch.no_grad():
            report = find_partial_gradient_modules(
                self.twin, self.column, self.row, *meta_args, **meta_kwargs
            )
        self.install(report)

    def install(self, report: PartialGradientReport) -> None:
        """Keep ``report`` (also as ``model._tp_partial_gradient_report``), refuse what it cannot
        make exact, and put "f" on the output of every module it names."""
        model = self.model()
        self.report = report
        object.__setattr__(model, "_tp_partial_gradient_report", report)
        if report.unfixable:
            raise _unfixable_error(report)
        for path in report.modules:
            model.get_submodule(path).register_forward_hook(_copy_output_hook(self.group))
        self.twin = None  # found once: the twin's structure is not needed again


class _NoHeights:
    """The twin's recorders note heights for the domain probe; the guard's twin notes none."""

    def sink(self, owner, height: int, width: int) -> None:
        return None


@torch._dynamo.assume_constant_result
def _detect_at_trace(guard: PartialGradientGuard, token, args, kwargs) -> bool:
    guard.detect(token, args, kwargs)
    return True


def _set_stance(stance: str) -> str:
    """Set the compiler stance, returning the previous one (torch >= 2.6)."""
    compiler = torch.compiler
    if not hasattr(compiler, "set_stance"):
        return stance
    try:
        from torch._dynamo.eval_frame import _stance

        previous = _stance.stance
    except (ImportError, AttributeError):
        previous = "default"
    compiler.set_stance(stance)
    return previous


def _all_reduce_hook(group):
    def hook(grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=group)
        return grad

    return hook


def _copy_output_hook(group):
    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            return CopyToTensorParallel.apply(output, group)
        flat = tree_flatten(output)
        leaves = [
            CopyToTensorParallel.apply(t, group) if isinstance(t, torch.Tensor) else t
            for t in flat[0]
        ]
        return flat[1].unflatten(leaves)

    return hook


def replicated_gradient_spread(named_parameters, group) -> list[tuple[str, float, float]]:
    """``(name, max |difference| across the tp ranks, max |gradient|)`` of each replicated
    parameter's gradient (its local tensor under FSDP2: tp peers hold the same dp shard), the
    maxima taken over every rank so that all ranks return the same rows.  Collective over the
    default group: every rank calls it with the same parameters, in order."""
    names, figures = [], []
    for name, param in named_parameters:
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if hasattr(grad, "to_local") else grad
        high, low = local.detach().clone(), local.detach().clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        empty = high.numel() == 0
        names.append(name)
        figures.append(
            (0.0, 0.0) if empty else ((high - low).abs().max().item(), high.abs().max().item())
        )
    if not names:
        return []
    table = torch.tensor(figures, dtype=torch.float64, device=local.device)
    dist.all_reduce(table, op=dist.ReduceOp.MAX)
    return [(n, float(d), float(r)) for n, (d, r) in zip(names, table.tolist())]
