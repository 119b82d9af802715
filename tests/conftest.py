import os

# torch.compile imports networkx lazily: a forked rank importing it while a thread of the parent
# (a forecast writer, a loader) held an import lock died once with importlib's KeyError in
# _lock_unlock_module; imported here, no rank imports it after the fork.
import networkx  # noqa: F401
import torch

# DTensor imports torch._dynamo lazily; importing it once here lets every forked rank inherit it
# instead of paying several seconds per worker.
import torch._dynamo  # noqa: F401

# Tests compare against single-process references computed in this process; keep the parent on
# one thread so references and forked workers see the same kernels.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
