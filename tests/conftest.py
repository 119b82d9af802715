import os

import torch

# Tests compare against single-process references computed in this process; keep the parent on
# one thread so references and forked workers see the same kernels.
torch.set_num_threads(1)
os.environ.setdefault("OMP_NUM_THREADS", "1")
