"""miles-credit model classes that stay refused under domain parallelism, each for a reason that
holds for every configuration of the class (not only with ``model.interp: true``), and the
configurations of otherwise exact classes that are refused.

* the regional ``wrf`` (``credit.models.swin_wrf.WRFTransformer``) and ``dscale``
  (``credit.models.dscale_wrf.DscaleTransformer``) models: FuXi's structure on a regional grid.
  Their ``CubeEmbedding`` reshapes to the stored GLOBAL ``patches_resolution``, their
  ``UTransformer`` crops the window padding it added with slices of the global grid, and the
  un-patchify reshapes to the global ``Lat x Lon``: on a shard each of these is wrong (the FuXi
  adapter, ``fuxi.DomainFuxi``, covers ``credit.models.fuxi.Fuxi`` only).  ``WRFTransformer``
  also adds the embedding of a second grid, the boundary input ``x_outside``
  (``param_outside``'s image size), to the interior's.  Their grid has no poles and no periodic
  longitude: nothing here gives it the global grid's rules (the ``earth`` padding, a longitude
  wrap); their own ``TensorPadding`` and ``ZeroPad2d`` are the boundaries the model declares.
* ``graph`` (``GraphResTransfGRU``): messages along the edges of a graph of nodes, no rows;
* ``crossformer-ensemble`` / ``crossformer-style`` (``CrossFormerWithNoise``) is NOT refused
  here: its ``StochasticDecompositionLayer`` s draw ``torch.randn(B, C, H, W)`` of the shape they
  are given (a shard's), which ``domain/random_draws.py`` turns into the rows of one process's
  draw (the converter installs it); with ``interp: true`` its interpolation is refused as any
  CREDIT model's outside ``credit_interp``'s family (``fuxi._global_grid_reason``).
* ``crossformer-diffusion`` (``CrossFormerDiffusion``) with ``patch_height`` / ``patch_width``
  > 1: its ``CubeEmbedding`` reshapes to the global ``patches_resolution`` too.  With patches of
  1 (its default) it is exact: the time embedding is per sample (every rank computes it), the
  conditioning input ``x_cond`` comes sharded like ``x``, and its padding and interpolation
  are those of the CrossFormer family (``credit_interp.DomainInterpModel``).
"""

from __future__ import annotations

from torch import nn

__all__ = [
    "REFUSED_MODELS",
    "REGIONAL_MODELS",
    "credit_refusal_reason",
]

_FUXI_LIKE = (
    "like FuXi, its CubeEmbedding reshapes to the stored global patches_resolution, its "
    "UTransformer crops the window padding it added with slices of the global grid, and its "
    "output is un-patchified by a reshape to the global Lat x Lon (the FuXi adapter covers "
    "credit.models.fuxi.Fuxi only)"
)
_REGIONAL = (
    "; its grid is regional (no poles, no periodic longitude: its boundaries are the padding "
    "the model declares), so no global rule may stand in for them; use domain: 1"
)

REGIONAL_MODELS = {
    "credit.models.swin_wrf.WRFTransformer": (
        "miles-credit's regional WRFTransformer (model.type wrf) cannot be domain parallel: "
        + _FUXI_LIKE
        + ", and it adds the embedding of the boundary grid x_outside (param_outside's image "
        "size, another grid than the interior's) to the interior's" + _REGIONAL
    ),
    "credit.models.dscale_wrf.DscaleTransformer": (
        "miles-credit's regional DscaleTransformer (model.type dscale) cannot be domain "
        "parallel: " + _FUXI_LIKE + _REGIONAL
    ),
}

_DIFFUSION = "credit.models.wxformer.crossformer_diffusion.CrossFormerDiffusion"

REFUSED_MODELS = {
    **REGIONAL_MODELS,
    "credit.models.graph.GraphResTransfGRU": (
        "miles-credit's GraphResTransfGRU (model.type graph) cannot be domain parallel: it "
        "passes messages along graph edges between arbitrary nodes (torch_geometric), there "
        "are no latitude rows to shard; use domain: 1"
    ),
}


def _qualified(module: nn.Module) -> str:
    return f"{type(module).__module__}.{type(module).__qualname__}"


def credit_refusal_reason(module: nn.Module) -> str | None:
    """Why a miles-credit model class (or this configuration of it) cannot be domain parallel,
    or None."""
    name = _qualified(module)
    if name in REFUSED_MODELS:
        return REFUSED_MODELS[name]
    if name == _DIFFUSION and (module.patch_height > 1 or module.patch_width > 1):
        return (
            "miles-credit's CrossFormerDiffusion with patch_height / patch_width "
            f"{module.patch_height} / {module.patch_width} cannot be domain parallel: its "
            "CubeEmbedding reshapes to the stored global patches_resolution; use patches of 1 "
            "(its default) or domain: 1"
        )
    return None
