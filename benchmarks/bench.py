"""``credit-parallel bench`` as a script: the whole benchmark suite (see credit_parallel.tools.bench).

.venv/bin/python benchmarks/bench.py                       # default suite, outputs/bench/
.venv/bin/python benchmarks/bench.py --quick               # smoke run
.venv/bin/python benchmarks/bench.py --docs outputs/bench/performance.md   # not docs/: it replaces the whole page
.venv/bin/python benchmarks/bench.py --models conv_stack/large --layouts 1x1x1,1x1x2
"""

from __future__ import annotations

from credit_parallel.tools.bench import main

__all__ = ["main"]

if __name__ == "__main__":
    raise SystemExit(main())
