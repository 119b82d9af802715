"""The options of a domain-parallel layer: one small frozen object, given at construction.

A layer is configured once, when it is built (``options=`` on its constructor; the converter
builds every layer with the options its plan decided, ``convert.py`` / ``plan.py``), and not
poked from outside afterwards.  Where an API must change an option of a built layer
(:func:`~credit_parallel.domain.layers.split_conv.set_model_overlap`, a benchmark choosing the halo path),
it goes through ONE method, :meth:`OptionsMixin.configure`, which replaces the layer's options
object as a whole (checked like at construction).

Which options a layer reads depends on its family: every layer names ``module_path`` in its
errors; the convolutions read all the others (``conv.py``), a padding layer ``fused_into``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["LayerOptions", "OptionsMixin", "check_overlap"]


def check_overlap(enabled):
    """``enabled`` if it is True, False or None (the default, off); else ``TypeError``."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"halo overlap must be True, False or None (default), got {enabled!r}")
    return enabled


@dataclass(frozen=True)
class LayerOptions:
    """How one domain-parallel layer runs (the arithmetic is the same under every choice).

    * ``module_path``: the layer's path in its model, named in errors (None: not converted).
    * ``overlap``: wait for the halo rows after the shard's own computation (split conv only);
      None follows ``overlap.overlap_enabled``'s measured default.
    * ``split_halo``: convolve around the halo without assembling the window
      (``split_conv.SplitConv``); False: the window path; None: the default rule (``conv.py``).
    * ``side_stream``: pack and post the exchange on the device's exchange stream (CUDA only;
      takes the window path).
    * ``fused_pad``: (a conv) the padding layer whose exchange this conv does (``fusion.py``).
    * ``fused_into``: (a padding layer) the conv that exchanges for it; the pad passes through.
    * ``shared_input``: (a conv) the :class:`~credit_parallel.domain.exchange.shared_input.SharedInputExchange`
      of the sibling convolutions it shares its input exchange with.
    * ``fused_norm``: (a GroupNorm and the conv after it) the
      :class:`~credit_parallel.domain.layers.norm_halo.NormConvLink` through which the norm's
      statistics travel with the conv's halo exchange (one call per direction for both).
    """

    module_path: str | None = None
    overlap: bool | None = None
    split_halo: bool | None = None
    side_stream: bool = False
    fused_pad: object | None = field(default=None, repr=False, compare=False)
    fused_into: object | None = field(default=None, repr=False, compare=False)
    shared_input: object | None = field(default=None, repr=False, compare=False)
    fused_norm: object | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        check_overlap(self.overlap)
        if self.split_halo is not None and not isinstance(self.split_halo, bool):
            raise TypeError(f"split_halo must be True, False or None, got {self.split_halo!r}")
        if not isinstance(self.side_stream, bool):
            raise TypeError(f"side_stream must be True or False, got {self.side_stream!r}")
        if self.module_path is not None and not isinstance(self.module_path, str):
            raise TypeError(f"module_path must be a string or None, got {self.module_path!r}")


class OptionsMixin:
    """The options of a domain-parallel layer: read through :attr:`options` (and the
    ``module_path`` property), replaced only through :meth:`configure`."""

    _options: LayerOptions = LayerOptions()

    @property
    def options(self) -> LayerOptions:
        return self._options

    @property
    def module_path(self) -> str | None:
        return self._options.module_path

    def configure(self, **changes):
        """Replace this layer's options by a copy with ``changes`` (names of
        :class:`LayerOptions` fields); returns the layer.  The one way to change an option of a
        built layer (e.g. ``set_model_overlap``); read at each forward."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(LayerOptions)}
        if unknown:
            raise TypeError(
                f"{type(self).__name__}.configure: unknown option(s) {sorted(unknown)}; "
                f"options are {[f.name for f in dataclasses.fields(LayerOptions)]}"
            )
        self._options = dataclasses.replace(self._options, **changes)
        return self
