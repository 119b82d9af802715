"""Where domain ranks talk: every send, receive and collective of domain parallelism.

* :mod:`.halo` — halo rows and their gradients: one batched point-to-point call per layer and
  direction (:func:`~.halo.exchange_rows_batched`, :class:`~.halo.HaloExchange`);
* :mod:`.collectives` — rows all-gathered / scattered, small statistics;
* :mod:`.ops` — the same communication as ``torch.library`` custom ops with fake
  implementations, which ``torch.compile`` traces instead of breaking the graph;
* :mod:`.shared_input` — one exchange for several convolutions of one tensor;
* :mod:`.streams` — the side CUDA stream; :mod:`.traffic` — opt-in traffic counters.
"""
