"""Where domain ranks talk: every send, receive and collective of domain parallelism.

* :mod:`.halo` — the differentiable row exchange (:func:`~.halo.exchange_rows_batched`,
  :func:`~.halo.exchange_rows`) and the seed's :class:`~.halo.HaloExchange`, built from
  :mod:`.p2p` (the messages, one batched point-to-point call per layer and direction, and
  :class:`~.p2p.PendingExchange`) and :mod:`.windows` (the window of global rows assembled from
  the shard and the received rows; its gradient scattered back); :mod:`.replay` plans each
  exchange's messages once per (plans, shapes, peers, group) and replays them;
* :mod:`.collectives` — rows all-gathered / scattered, small statistics;
* :mod:`.ops` — the same communication as ``torch.library`` custom ops with fake
  implementations, which ``torch.compile`` traces instead of breaking the graph;
* :mod:`.shared_input` — one exchange for several convolutions of one tensor;
* :mod:`.streams` — the side CUDA stream; :mod:`.traffic` — opt-in traffic counters.
"""
