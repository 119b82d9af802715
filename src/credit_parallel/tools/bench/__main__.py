"""``python -m credit_parallel.tools.bench``: the benchmark suite as a script."""

from .cli import main

raise SystemExit(main())
