"""The CREDIT drop-in gaps of issue 27, against miles-credit 2026.2's own classes and config:
``unpad_shard_interp`` with CREDIT's ``TensorPadding``, tensor parallelism on a CrossFormer built
with its default spectral norm, and ``plan`` on CREDIT's 0.25-degree example config (the model
block prepared by CREDIT's own parser).  (``halo_width`` before a forward against CREDIT's conv
classes: tests/test_halo_views.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from credit_parallel import DomainParallelManager, gather_tensor, shard_tensor, unpad_shard_interp
from credit_parallel.testing import assert_parity, domain_parity_errors, run_on_ranks
from miles_credit import import_credit


# --------------------------------------------------------------------------- TensorPadding
def _tensor_padding(pad_lat, pad_lon, mode="earth"):
    return import_credit("credit.boundary_padding").TensorPadding(
        mode=mode, pad_lat=pad_lat, pad_lon=pad_lon
    )


class _UnpadWithCreditPadding(nn.Module):
    """Reference (manager None): CREDIT's own ``TensorPadding.unpad`` of the global tensor, then
    a bilinear resize of every (H, W) plane; the domain copy calls ``unpad_shard_interp`` with the
    same ``TensorPadding`` on its shard."""

    def __init__(self, padding, image_h, image_w):
        super().__init__()
        self.padding, self.image_h, self.image_w, self.manager = padding, image_h, image_w, None

    def forward(self, y):
        if self.manager is not None:
            return unpad_shard_interp(y, self.padding, self.manager, self.image_h, self.image_w)
        y = self.padding.unpad(y)
        if tuple(y.shape[-2:]) != (self.image_h, self.image_w):
            lead = y.shape[:-2]
            y = F.interpolate(
                y.reshape(lead[0], -1, *y.shape[-2:]),
                size=(self.image_h, self.image_w),
                mode="bilinear",
            )
            y = y.reshape(*lead, self.image_h, self.image_w)
        return y


def _set_manager(module, mgr):
    module.manager = mgr
    return module


class _Pads:  # any object with pad_NS / pad_WE
    pad_NS, pad_WE = [2, 3], [1, 2]


def _tensor_padding_worker(rank, world):
    torch.set_default_dtype(torch.float64)
    mgr = DomainParallelManager(world, world)
    gen = torch.Generator().manual_seed(5)
    errors, equal = {}, []
    cases = [
        # (padding, y shape (padded), image_h, image_w): 4-D and CREDIT's 5-D (B, C, T, H, W)
        (_tensor_padding((2, 3), (1, 2)), (2, 3, 18, 12), 13, 9),  # strip only, uneven 13
        (_tensor_padding([1, 1], [2, 2], "mirror"), (1, 2, 1, 15, 10), 13, 6),  # 5-D, strip only
        (_tensor_padding((3, 2), (0, 0)), (1, 2, 2, 19, 8), 11, 10),  # 5-D, strip + resize
        (_tensor_padding((0, 0), (2, 2)), (2, 2, 14, 12), 14, 8),  # longitude only
    ]
    for i, (pad, shape, ih, iw) in enumerate(cases):
        y = torch.randn(*shape, generator=gen)
        errs = domain_parity_errors(
            lambda pad=pad, ih=ih, iw=iw: _UnpadWithCreditPadding(pad, ih, iw),
            y,
            mgr,
            convert=_set_manager,
        )
        errors.update({f"case{i}/{k}": v for k, v in errs.items()})
        # the same result as the dict form, bitwise, and the gathered result has CREDIT's shape
        mgr.begin_forward(("tp-pad", i))
        local = shard_tensor(y, -2, mgr)
        via_object = unpad_shard_interp(local, pad, mgr, ih, iw)
        as_dict = {"pad_lat": tuple(pad.pad_NS), "pad_lon": tuple(pad.pad_WE)}
        via_dict = unpad_shard_interp(local, as_dict, mgr, ih, iw)
        full = gather_tensor(via_object, -2, mgr)
        equal.append((torch.equal(via_object, via_dict), tuple(full.shape)))
    mgr.begin_forward(("tp-pad", "plain"))
    y = torch.randn(1, 2, 17, 11, generator=gen)
    local = unpad_shard_interp(shard_tensor(y, -2, mgr), _Pads(), mgr, 12, 8)
    plain = torch.equal(local, shard_tensor(y[..., 2:14, 1:9], -2, mgr, register=False))
    return errors, equal, plain


@pytest.mark.parametrize("world", [2, 3])
def test_unpad_shard_interp_takes_credits_tensor_padding(world):
    for errors, equal, plain in run_on_ranks(_tensor_padding_worker, world):
        assert len(errors) >= 8
        assert_parity(errors, torch.float64)
        assert equal == [
            (True, (2, 3, 13, 9)),
            (True, (1, 2, 1, 13, 6)),
            (True, (1, 2, 2, 11, 10)),
            (True, (2, 2, 14, 8)),
        ]
        assert plain


def test_unpad_shard_interp_one_process_tensor_padding_is_credits_unpad():
    pad = _tensor_padding((2, 1), (3, 3))
    y = torch.randn(1, 4, 1, 12, 20, dtype=torch.float64)
    assert torch.equal(unpad_shard_interp(y, pad, None, 9, 14), pad.unpad(y))


def test_unpad_shard_interp_names_what_it_accepts():
    with pytest.raises(ValueError, match="pad_NS/pad_WE"):
        unpad_shard_interp(torch.zeros(1, 1, 4, 4), object(), None, 4, 4)
    bad = _tensor_padding((1, -1), (0, 0))
    with pytest.raises(ValueError, match="pad_NS"):
        unpad_shard_interp(torch.zeros(1, 1, 4, 4), bad, None, 4, 4)
