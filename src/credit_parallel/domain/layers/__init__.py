"""Domain-parallel layers, one file per layer family; each wraps the original module, keeps its
parameter names, and answers the geometry protocol of :mod:`credit_parallel.domain.geometry`.

* :mod:`.conv` — (transposed) convolutions of any kernel / stride / padding / dilation, and the
  periodic convolution; :mod:`.conv_geometry` their pure row geometry; :mod:`.split_conv` the
  convolution that never assembles its window (and halo / compute overlap);
* :mod:`.norm` — GroupNorm with statistics over the whole globe; :mod:`.norm_halo` — its
  statistics sent with the next convolution's halo exchange (one sync point per direction);
* :mod:`.padding` — padding over latitude at the global edges only;
* :mod:`.resample` — interpolation (:mod:`.interp_rows` its index arithmetic);
  :mod:`.pixel_shuffle` — PixelShuffle / PixelUnshuffle;
* :mod:`.gather` — ``nonlocal_policy="gather"``: any module run whole on the globe.
"""
