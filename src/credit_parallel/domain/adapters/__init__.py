"""Model-specific adapters: client classes recognised by qualified class name (the library
imports none of them) and made exact under latitude sharding.

* :mod:`.recognise` — which attention module gets which form of :mod:`..attention`
  (miles-credit's and timm's classes by name, or a user's ``_domain_attention`` declaration);
* :mod:`.swin` — timm's and miles-credit's Swin-V2 blocks and patch merging on (B, H, W, C)
  shards, the cyclic shift over H as a row exchange;
* :mod:`.fuxi` — miles-credit's FuXi, its forward run unmodified on the rank's rows;
* :mod:`.tensor_padding` — CREDIT's ``TensorPadding`` inside a model's forward;
* :mod:`.stand_ins` — what the CREDIT adapters share: the stand-ins swapped into a model for
  one forward (``_ShardedPadding``, ``_RecordingPadding``, ``_Key``, ``_swapped``) and the row
  arithmetic of ``TensorPadding``;
* :mod:`.credit_interp` — the CrossFormer family's interpolation to the global image size
  (``model.interp: true``), and the converter's CREDIT-model step.
* :mod:`.nextgen` — miles-credit's ``NextGenWXFormer``: its spectral GNN bottleneck (own columns
  of ``agg_w``, one all-reduce), column attention and stage-to-stage interpolations;
* :mod:`.regional` — the miles-credit classes refused whatever their configuration (the
  regional ``wrf`` / ``dscale``, the noise-drawing ensemble, the graph model), with the reason.
"""
