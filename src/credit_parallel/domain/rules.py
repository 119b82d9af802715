"""The converter's rule registry: which domain layer replaces a module of a given type.

``register_domain_rule(type or qualified class name, rule)``; ``rule(module, manager,
shard_dim)`` returns the replacement, or None to leave the module alone.  The built-in rules
(convolutions, the periodic conv, GroupNorm, upsampling, pixel (un)shuffle, the 2-D padding
modules) are registered here; ``convert.py`` walks the model and asks :func:`domain_rule_for`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from .layers.conv import (
    DomainParallelConv2d,
    DomainParallelConv3d,
    DomainParallelConvTranspose2d,
    DomainParallelConvTranspose3d,
    DomainParallelPeriodicConv2d,
    conv_needs_domain_wrapper,
)
from .layers.norm import DomainParallelGroupNorm
from .layers.padding import DomainParallelPad
from .layers.pixel_shuffle import DomainParallelPixelShuffle, DomainParallelPixelUnshuffle
from .layers.resample import DomainParallelInterpolate

__all__ = ["CONV_BASES", "DOMAIN_RULES", "DomainRule", "domain_rule_for", "register_domain_rule"]

DomainRule = Callable[[nn.Module, object, int], "nn.Module | None"]
# {module type | qualified class name: rule(module, manager, shard_dim) -> replacement or None}
DOMAIN_RULES: dict = {}


def register_domain_rule(key, rule: DomainRule) -> None:
    """Register ``rule(module, manager, shard_dim) -> replacement module or None`` (None = leave
    the module alone) for a module type, or for a qualified class name string such as
    ``"timm.models.swin_transformer_v2.SwinTransformerV2Block"`` (matches classes of packages
    this library does not import; a name without a dot matches that class name in any module).
    The most specific class of a module's MRO with a rule wins."""
    if not (isinstance(key, type) or (isinstance(key, str) and key)) or not callable(rule):
        raise TypeError(
            f"register_domain_rule needs a module type or a qualified class name and a callable, "
            f"got {key!r}: {rule!r}"
        )
    DOMAIN_RULES[key] = rule


def domain_rule_for(module: nn.Module) -> DomainRule | None:
    """The registered rule of ``module``'s most specific class, or None."""
    for cls in type(module).__mro__:
        for key in (cls, f"{cls.__module__}.{cls.__qualname__}", cls.__name__):
            rule = DOMAIN_RULES.get(key)
            if rule is not None:
                return rule
    return None


# (conv base, input rank): the built-in conv rules, most specific first (also what the
# converter checks a conv subclass with its own forward against)
CONV_BASES = (
    (nn.ConvTranspose3d, 5),
    (nn.ConvTranspose2d, 4),
    (nn.Conv3d, 5),
    (nn.Conv2d, 4),
)


def _conv_rule(base: type, layer: type, rank: int) -> DomainRule:
    def rule(module, manager, shard_dim):
        # a subclass with its own forward is reported as unsafe before rules run
        if type(module).forward is not base.forward:
            return None
        if conv_needs_domain_wrapper(module, shard_dim % rank - 2):
            return layer(module, shard_dim, manager=manager)
        if getattr(manager, "is_tiled", False) and conv_needs_domain_wrapper(module, rank - 3):
            return layer(module, shard_dim, manager=manager)  # reaches other columns (tiles)
        return None  # row-local: left alone

    return rule


def _periodic_conv_rule(module, manager, shard_dim):
    if isinstance(getattr(module, "conv", None), nn.Conv2d) and isinstance(
        getattr(module, "padding", None), int
    ):
        return DomainParallelPeriodicConv2d(module, shard_dim, manager=manager)
    return None


def _upsample_rule(module, manager, shard_dim):
    return DomainParallelInterpolate(
        size=module.size,
        scale_factor=module.scale_factor,
        mode=module.mode,
        align_corners=module.align_corners,
        recompute_scale_factor=module.recompute_scale_factor,
        shard_dim=shard_dim,
        manager=manager,
    )


def _pad_rule(module, manager, shard_dim):
    top, bottom = module.padding[2], module.padding[3]
    if top == 0 and bottom == 0 and not getattr(manager, "is_tiled", False):
        return None  # longitude-only padding is row-local (not on lat x lon tiles)
    return DomainParallelPad(module, manager=manager)


for _base, _layer, _rank in (
    (nn.ConvTranspose3d, DomainParallelConvTranspose3d, 5),
    (nn.ConvTranspose2d, DomainParallelConvTranspose2d, 4),
    (nn.Conv3d, DomainParallelConv3d, 5),
    (nn.Conv2d, DomainParallelConv2d, 4),
):
    register_domain_rule(_base, _conv_rule(_base, _layer, _rank))
register_domain_rule("PeriodicConv2d", _periodic_conv_rule)
register_domain_rule(nn.GroupNorm, lambda m, mgr, d: DomainParallelGroupNorm(m, manager=mgr))
register_domain_rule(nn.Upsample, _upsample_rule)
register_domain_rule(nn.PixelShuffle, lambda m, mgr, d: DomainParallelPixelShuffle(m, manager=mgr))
register_domain_rule(
    nn.PixelUnshuffle, lambda m, mgr, d: DomainParallelPixelUnshuffle(m, manager=mgr)
)
for _pad in (nn.ZeroPad2d, nn.ConstantPad2d, nn.ReflectionPad2d, nn.ReplicationPad2d):
    register_domain_rule(_pad, _pad_rule)
register_domain_rule(nn.CircularPad2d, _pad_rule)
