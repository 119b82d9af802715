"""The conversion plan: what ``convert_to_domain_parallel`` does to every module of a model,
decided before anything is replaced (pure data; built by ``convert.plan_conversion``, no
process group needed: layers resolve their manager when they run).

The converter first DECIDES, then APPLIES (``convert.apply_conversion_plan``); the layout planner
(``planner/``) reads the same plan instead of replaying the converter's steps.  A plan holds,
in the order they were decided:

* :class:`PlannedModule` per replaced module: its path, the stage that decided it (``adapter``:
  a whole CREDIT model whose forward reads the global grid, FuXi; ``attention``: attention made
  exact whole, Swin blocks and patch mergings included; ``custom``: the caller's
  ``custom_converters``; ``rule``: the registered rule of its type; ``gather``: run on the whole
  globe under ``nonlocal_policy="gather"``; ``strips``: on lat x lon tiles, the 1-D decisions
  at and below it run on latitude strips, ``tiles_convert.relayout_on_tiles``), the built replacement (already carrying its
  options: module path, shard dim) or the error that stops it;
* the modules refused as unsafe (``unsafe``; empty under the gather policy);
* the exchange fusions (``fusion.py``): :class:`PadConvFusion` (a padding layer and the conv
  after it exchange once) and :class:`SharedInputGroup` (sibling convs on one input share one
  exchange of the union of their windows); :class:`NormConvFusion` (a GroupNorm's statistics
  travel with the halo exchange of the conv after it, ``norm_halo.py``);
  :class:`HaloChainFusion` (opt-in: a run of stencil layers exchanges once per chain of them,
  ``layers/halo_chain.py``).

``str(plan)`` prints one line per decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .exchange.shared_input import sharing_step, union_windows
from .layers.conv import fused_pad_windows
from .layers.halo_chain import HaloChainRun

__all__ = [
    "STAGES",
    "ConversionPlan",
    "HaloChainFusion",
    "NormConvFusion",
    "PadConvFusion",
    "PlannedModule",
    "SharedInputGroup",
    "sharing_step",
]

STAGES = ("adapter", "attention", "custom", "rule", "gather", "strips")


@dataclass(frozen=True)
class PlannedModule:
    """One decision: the module at ``path`` ("<root>": the model) is replaced by
    ``replacement`` (None when ``error`` says why it cannot be)."""

    path: str
    stage: str
    original: nn.Module = field(repr=False, compare=False)
    replacement: nn.Module | None = field(repr=False, compare=False)
    error: Exception | None = field(default=None, repr=False, compare=False)

    @property
    def form(self) -> str:
        """The replacement's ``domain_form`` ("halo", "gather", "relayout", ...; "" if none)."""
        return getattr(self.replacement, "domain_form", "") or ""

    def __str__(self) -> str:
        old = type(self.original).__name__
        if self.error is not None:
            return f"{self.path}: {self.stage} {old}: cannot convert: {self.error}"
        form = f" [{self.form}]" if self.form else ""
        return f"{self.path}: {self.stage} {old} -> {type(self.replacement).__name__}{form}"


@dataclass(frozen=True)
class PadConvFusion:
    """A padding layer and the (non-transposed) conv after it: the conv exchanges the pad's
    input once with the two row maps composed, the pad passes its input through."""

    pad_path: str
    conv_path: str
    pad: nn.Module = field(repr=False, compare=False)
    conv: nn.Module = field(repr=False, compare=False)

    def windows(self, length: int, n: int) -> tuple:
        """Every rank's window over the pad's input of ``length`` rows."""
        return fused_pad_windows(self.pad, self.conv, length, n)

    def __str__(self) -> str:
        return f"fuse pad {self.pad_path} into conv {self.conv_path} (one exchange)"


@dataclass(frozen=True)
class SharedInputGroup:
    """Sibling convolutions that share ONE exchange of the union of their windows when called
    on the same tensor (at run time by the rule :func:`sharing_step`)."""

    paths: tuple[str, ...]
    layers: tuple = field(repr=False, compare=False)

    def windows(self, length: int, n: int) -> tuple:
        """Every rank's union window over an input of ``length`` rows."""
        geometries = tuple(m.geometry for m in self.layers)
        return union_windows(geometries, self.layers[0].spatial_index, length, n, 0)[0]

    def __str__(self) -> str:
        return f"share one input exchange: {', '.join(self.paths)}"


@dataclass(frozen=True)
class NormConvFusion:
    """A GroupNorm, an optional elementwise activation and the conv after them: the norm's
    statistics travel with the conv's halo exchange, one call per direction for both."""

    norm_path: str
    conv_path: str
    norm: nn.Module = field(repr=False, compare=False)
    activation: nn.Module | None = field(repr=False, compare=False)
    conv: nn.Module = field(repr=False, compare=False)

    def __str__(self) -> str:
        return f"norm {self.norm_path} statistics with the exchange of conv {self.conv_path}"


@dataclass(frozen=True)
class HaloChainFusion:
    """A run of stencil layers (and the activations / norms between them) in one
    ``nn.Sequential``: cut into chains per call geometry (``run.pieces``), each chain
    exchanging once for all its stencils (``layers/halo_chain.py``)."""

    container_path: str
    paths: tuple[str, ...]
    run: HaloChainRun = field(repr=False, compare=False)
    container: nn.Module = field(repr=False, compare=False)

    def __str__(self) -> str:
        how = "cut by the cost model" if self.run.mode == "auto" else f"<= {self.run.mode} stencils"
        return f"halo chain ({how}): {', '.join(self.paths)} (one exchange per chain)"


def halo_chain_mode(value):
    """``halo_chains`` as the converter reads it: None (off: False, None, 0), ``"auto"``
    (True or "auto") or a chain length k >= 2; anything else ``ValueError``."""
    if value is None or value is False or value == 0:
        return None
    if value is True or value == "auto":
        return "auto"
    if isinstance(value, int) and value >= 2:
        return value
    raise ValueError(f"halo_chains must be False, True, 'auto' or an int >= 2, got {value!r}")


@dataclass
class ConversionPlan:
    """Everything the converter decided for one model (see the module docstring)."""

    shard_dim: int
    nonlocal_policy: str
    modules: list[PlannedModule] = field(default_factory=list)
    unsafe: list[tuple[str, str]] = field(default_factory=list)  # (path, reason), refused
    gathered: list[tuple[str, str]] = field(default_factory=list)  # (path, why), gather policy
    pad_conv: list[PadConvFusion] = field(default_factory=list)
    shared_inputs: list[SharedInputGroup] = field(default_factory=list)
    norm_conv: list[NormConvFusion] = field(default_factory=list)
    halo_chains: list[HaloChainFusion] = field(default_factory=list)

    @property
    def errors(self) -> list[PlannedModule]:
        return [m for m in self.modules if m.error is not None]

    def replacements(self) -> list[PlannedModule]:
        """The decisions that replace a module (errors left out), in order."""
        return [m for m in self.modules if m.error is None]

    def keep_whole(self, path: str) -> list[str]:
        """Forget every decision strictly below ``path`` ("<root>": the model), returning their
        paths: the module there runs on the whole globe (the gather policy), so its
        descendants stay the original modules — a domain layer inside it would exchange or
        re-lay rows as if its input were a shard."""
        prefix = "" if path == "<root>" else f"{path}."
        below = [m.path != path and m.path.startswith(prefix) for m in self.modules]
        dropped = [m.path for m, drop in zip(self.modules, below) if drop]
        self.modules = [m for m, drop in zip(self.modules, below) if not drop]
        return dropped

    def __str__(self) -> str:
        lines = [f"conversion plan (shard_dim={self.shard_dim}, nonlocal={self.nonlocal_policy})"]
        lines += [f"  {m}" for m in self.modules]
        lines += [f"  {path}: refused: {reason}" for path, reason in self.unsafe]
        fusions = (*self.pad_conv, *self.shared_inputs, *self.norm_conv, *self.halo_chains)
        lines += [f"  {f}" for f in fusions]
        return "\n".join(lines)
