"""Moving tensors between the global and the sharded view: shard/gather (exact adjoints of each
other), whole batches, and the output un-padding of padded models.

``shard_tensor``/``shard_batch`` also register the global shape of the coming forward with the
manager, which is what lets every layer learn its input's global height without a collective in
steady state (see ``manager.py``), and a compiled graph derive it at trace time
(``traced_heights.py``).  An input a user sliced by hand states its global shape with
:func:`declare_global_shape`, which registers the same token ``shard_tensor`` would.
"""

from __future__ import annotations

import warnings
import weakref

import torch
import torch.nn.functional as F

from .exchange.collectives import all_gather_rows, scatter_rows
from .manager import get_domain_parallel_manager, is_tiled
from .rows import shard_range, shard_sizes
from .tiles import gather_tile, shard_tile, tile_range, unpad_tile

__all__ = [
    "declare_global_shape",
    "gather_tensor",
    "local_extent",
    "shard_batch",
    "shard_spatial",
    "shard_tensor",
    "unpad_shard_interp",
]


class _GatherOwner:
    """Names gather_tensor / unpad_shard_interp in a height lookup's errors (never cached)."""


_GATHER_OWNER = _GatherOwner()
# one interpolator per (manager, target size), so its global-height lookups stay cached
_UNPAD_INTERPOLATORS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _check_dim(x: torch.Tensor, dim: int, what: str) -> int:
    """``dim`` as a non-negative index of ``x``'s dimensions; ``ValueError`` outside them."""
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(
            f"{what}: dim {dim!r} is not a dimension of a {x.dim()}-D tensor of shape "
            f"{tuple(x.shape)} (valid: {-x.dim()} .. {x.dim() - 1})"
        )
    return dim % x.dim()


def _manager_or_none(manager):
    mgr = manager if manager is not None else get_domain_parallel_manager()
    if mgr is None or mgr.domain_world_size == 1:
        return None
    return mgr


def shard_tensor(
    x: torch.Tensor, dim: int = -2, manager=None, *, register: bool = True
) -> torch.Tensor:
    """This rank's balanced shard (``torch.tensor_split``) of the global tensor ``x`` along
    ``dim``.  Differentiable; its backward all-gathers.  Identity without a manager / domain 1.
    A dim shorter than the number of ranks leaves the last ranks with empty shards."""
    d = _check_dim(x, dim, "shard_tensor")
    mgr = _manager_or_none(manager)
    if mgr is None:
        return x
    if register:
        mgr.begin_forward(("shard_tensor", tuple(x.shape), d))
    if is_tiled(mgr):  # rows along d and columns along the last dim (SPEC §3b)
        return shard_tile(x, d, mgr)
    return scatter_rows(x, d, mgr)


def local_extent(
    manager, height: int, width: int | None = None, *, what: str = "declare_global_shape"
) -> list[tuple[int, int, str]]:
    """``[(local rows, height, "rows")]`` of this domain rank's balanced share, and on a lat x
    lon domain (a tiled manager, SPEC §3b) also ``(local columns, width, "columns")``
    (``width`` is then required; ``what`` names the caller in that error)."""
    if not is_tiled(manager):
        return [
            (shard_sizes(height, manager.domain_world_size)[manager.domain_rank], height, "rows")
        ]
    if width is None:
        raise ValueError(f"{what}: a lat x lon domain needs global_width (the global W) too")
    rows, cols = tile_range(height, width, manager.domain_shape, manager.domain_coords)
    return [(rows[1] - rows[0], height, "rows"), (cols[1] - cols[0], width, "columns")]


def declare_global_shape(
    x: torch.Tensor, global_shape, shard_dim: int = -2, *, manager=None
) -> torch.Tensor:
    """State the GLOBAL shape of ``x``, this rank's share of an input sliced by hand (not by
    :func:`shard_tensor`), for the coming forward; returns ``x`` itself.

    It registers with the manager the forward token ``shard_tensor`` registers for the global
    tensor, so a model compiled whole (``torch.compile``, either order, SPEC §5a) derives its
    layers' global heights at trace time, and an eager forward needs no collective to learn
    them.  ``x`` must hold this domain rank's balanced rows along ``dim`` (the rows
    ``shard_tensor`` would give it; on a lat x lon domain also its columns along the last dim);
    every other dim equals ``global_shape``'s.  Otherwise ``ValueError`` naming the dim.  No
    manager, or a domain of one rank: nothing to declare.

    Example::

        rows = slice(*shard_range(721, manager.domain_world_size, manager.domain_rank))
        x = declare_global_shape(x_global_on_disk[:, :, rows], (1, 71, 721, 1440), manager=mgr)
        y = compiled_model(x)
    """
    d = _check_dim(x, shard_dim, "declare_global_shape")
    mgr = _manager_or_none(manager)
    if mgr is None:
        return x
    shape = tuple(int(s) for s in global_shape)
    if len(shape) != x.dim():
        raise ValueError(
            f"declare_global_shape: global_shape {shape} has {len(shape)} dims, the local input "
            f"{tuple(x.shape)} has {x.dim()}"
        )
    sharded = [d] + ([x.dim() - 1] if is_tiled(mgr) else [])
    width = shape[-1] if is_tiled(mgr) else None
    for sd, (local, size, what) in zip(sharded, local_extent(mgr, shape[d], width)):
        if x.shape[sd] != local:
            raise ValueError(
                f"declare_global_shape: the input has {x.shape[sd]} {what} along dim {sd} but "
                f"domain rank {mgr.domain_rank} of {mgr.domain_world_size} owns {local} of "
                f"{size} {what} (slice it as shard_tensor does: domain.rows.shard_range)"
            )
    for i, (local, size) in enumerate(zip(x.shape, shape)):
        if i not in sharded and local != size:
            raise ValueError(
                f"declare_global_shape: dim {i} of the input is {local}, of global_shape {size}; "
                "only the sharded dims differ"
            )
    mgr.begin_forward(("shard_tensor", shape, d))
    return x


def gather_tensor(x: torch.Tensor, dim: int = -2, manager=None) -> torch.Tensor:
    """All-gather the balanced shards back into the global tensor (uneven sizes supported).
    Differentiable: each rank's gradient is the sum over ranks of the gradients of its rows."""
    d = _check_dim(x, dim, "gather_tensor")
    mgr = _manager_or_none(manager)
    if mgr is None:
        return x
    owner = _GATHER_OWNER
    if is_tiled(mgr):
        return gather_tile(x, d, mgr, owner)
    # not cached: gather_tensor is handed unrelated tensors under one registered token (the
    # outputs of different models or layers), so (token, call index) does not determine the
    # height; it is itself a collective, and one tiny length all_gather more is cheap
    length = mgr.global_length(owner, x.shape[d], cached=False)
    return all_gather_rows(x, d, length, mgr)


def shard_batch(
    batch: dict,
    shard_dim_5d: int = -2,
    shard_dim_4d: int = -2,
    manager=None,
    *,
    spatial_dims_5d: int | None = None,
    spatial_dims_4d: int | None = None,
) -> dict:
    """A new dict with every 4-D and 5-D tensor sharded (5-D along ``shard_dim_5d``, 4-D along
    ``shard_dim_4d``); everything else is passed through untouched.

    Args:
        batch: the global batch, ``{name: tensor or anything}``.
        shard_dim_5d: the dimension sharded in 5-D tensors (B, C, T, H, W): -2, latitude.
        shard_dim_4d: the dimension sharded in 4-D tensors (B, C, H, W): -2, latitude.
        manager: the domain manager; without one (or at domain size 1) a shallow copy.
        spatial_dims_5d, spatial_dims_4d: CREDIT's (and SPEC §3's) names of ``shard_dim_5d`` /
            ``shard_dim_4d``; deprecated, still accepted with a ``DeprecationWarning``.

    Returns:
        A new dict: this rank's rows of every 4-D and 5-D tensor, the other values as given.

    Example::

        local = shard_batch(batch, manager=get_domain_manager(model))
    """
    shard_dim_5d = _renamed("spatial_dims_5d", spatial_dims_5d, "shard_dim_5d", shard_dim_5d)
    shard_dim_4d = _renamed("spatial_dims_4d", spatial_dims_4d, "shard_dim_4d", shard_dim_4d)
    mgr = _manager_or_none(manager)
    if mgr is None:
        return dict(batch)
    out, token = {}, []
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() in (4, 5):
            d = shard_dim_5d if value.dim() == 5 else shard_dim_4d
            out[key] = shard_tensor(value, d, mgr, register=False)
            token.append((str(key), tuple(value.shape), d % value.dim()))
        else:
            out[key] = value
    mgr.begin_forward(("shard_batch", tuple(token)))
    return out


def _renamed(old: str, old_value, new: str, value: int) -> int:
    """``value``, or ``old_value`` given under the deprecated keyword ``old`` (with a warning)."""
    if old_value is None:
        return value
    if value != -2:
        raise TypeError(f"shard_batch: pass {new}= only (got both {new}= and its old name {old}=)")
    warnings.warn(
        f"shard_batch({old}=...) is deprecated; pass {new}= (the same dimension)",
        DeprecationWarning,
        stacklevel=3,
    )
    return old_value


def shard_spatial(tensor: torch.Tensor, manager) -> torch.Tensor:
    """Shard a B,C,H,W or B,C,T,H,W tensor along latitude (dim -2); identity without domain."""
    return shard_tensor(tensor, -2, manager)


def _pad_pair(value, key):
    if value is None:
        return 0, 0
    if isinstance(value, int) and not isinstance(value, bool):
        return value, value
    if (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        return int(value[0]), int(value[1])
    raise ValueError(f"padding_opt.{key} must be an int or a pair of ints >= 0, got {value!r}")


def _paddings(padding_opt) -> tuple[int, int, int, int]:
    """(north, south, west, east) rows / columns of ``padding_opt``: None, a dict with
    ``pad_lat`` / ``pad_lon`` (and optional ``activate``), or CREDIT's ``TensorPadding`` (any
    object with ``pad_NS`` / ``pad_WE``, as ``credit.trainers.trainer_gen2`` passes it)."""
    if padding_opt is None:
        return 0, 0, 0, 0
    if isinstance(padding_opt, dict):
        if not padding_opt.get("activate", True):
            return 0, 0, 0, 0
        lat, lon, names = (
            padding_opt.get("pad_lat"),
            padding_opt.get("pad_lon"),
            ("pad_lat", "pad_lon"),
        )
    elif hasattr(padding_opt, "pad_NS") and hasattr(padding_opt, "pad_WE"):
        lat, lon, names = padding_opt.pad_NS, padding_opt.pad_WE, ("pad_NS", "pad_WE")
    else:
        raise ValueError(
            "padding_opt must be a dict with pad_lat/pad_lon or an object with pad_NS/pad_WE "
            f"(CREDIT's TensorPadding), got {type(padding_opt).__name__}"
        )
    return (*_pad_pair(lat, names[0]), *_pad_pair(lon, names[1]))


def unpad_shard_interp(
    y_pred: torch.Tensor, padding_opt, manager, image_h: int, image_w: int
) -> torch.Tensor:
    """Strip a padded model's output back to the ``image_h`` x ``image_w`` grid, sharded.

    ``padding_opt``: None, a dict with ``pad_lat`` (north, south) and ``pad_lon`` (west, east)
    (ints or pairs; ``activate: False`` disables it), or CREDIT's ``TensorPadding`` / any object
    with ``pad_NS`` and ``pad_WE`` (the same pairs).  Longitude padding is stripped on
    every rank, north padding from the first domain rank's rows, south padding from the last's,
    and the rows are re-balanced so the result is exactly ``shard_tensor`` of the un-padded
    global output (uneven shards included).  If the un-padded grid still differs from
    ``image_h`` x ``image_w``, it is bilinearly interpolated to it (domain-parallel, exact).
    """
    from .exchange.halo import exchange_rows
    from .layers.resample import DomainParallelInterpolate

    pad_n, pad_s, pad_w, pad_e = _paddings(padding_opt)
    if is_tiled(_manager_or_none(manager)):  # rows and columns stripped across the tiles
        pads = (pad_n, pad_s, pad_w, pad_e)
        return unpad_tile(y_pred, pads, manager, image_h, image_w, _GATHER_OWNER)
    w = y_pred.shape[-1]
    if pad_w or pad_e:
        y_pred = y_pred[..., pad_w : w - pad_e]
    mgr = _manager_or_none(manager)
    dim = y_pred.dim() - 2
    if mgr is None:
        h = y_pred.shape[dim]
        y = y_pred.narrow(dim, pad_n, h - pad_n - pad_s)
    else:
        n = mgr.domain_world_size
        length = mgr.global_length(
            _GATHER_OWNER, y_pred.shape[dim], cached=False
        )  # as gather_tensor
        new_len = length - pad_n - pad_s
        if new_len < 1:
            raise ValueError(f"unpad_shard_interp: {new_len} rows left after removing the padding")
        windows = tuple(
            tuple(range(a + pad_n, b + pad_n))
            for a, b in (shard_range(new_len, n, r) for r in range(n))
        )
        y = exchange_rows(y_pred, windows, length, dim, mgr)
        length = new_len
    global_h = length if mgr is not None else y.shape[dim]
    if (global_h, y.shape[-1]) == (image_h, image_w):
        return y
    lead = y.shape[:-2]  # (B, C, T, H, W): every (H, W) plane interpolated alike
    y = y.reshape(lead[0], -1, *y.shape[-2:]) if y.dim() > 4 else y
    if mgr is None:
        y = F.interpolate(y, size=(image_h, image_w), mode="bilinear")
    else:
        cache = _UNPAD_INTERPOLATORS.setdefault(mgr, {})
        interp = cache.get((image_h, image_w))
        if interp is None:
            interp = DomainParallelInterpolate(
                size=(image_h, image_w), mode="bilinear", manager=mgr
            )
            cache[(image_h, image_w)] = interp
        y = interp(y)
    return y.reshape(*lead, *y.shape[-2:])
