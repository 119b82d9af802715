import os

import torch
import torch._dynamo  # noqa: F401 - DTensor imports it lazily; importing it once here lets every

# forked rank inherit it instead of paying several seconds per worker

# Tests compare against single-process references computed in this process; keep the parent on
# one thread so references and forked workers see the same kernels.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
