"""Tools above the library, used the way a user would use it.

* ``verify`` — ``credit-parallel verify``: one batch, single process vs the configured layout;
* ``bench/`` — the benchmark suite and the GPU node check; ``profile`` — where a step's time goes;
* ``launcher`` — N local ranks through torchrun; ``forensics`` — which rank failed first, and how;
* ``mesh_demo`` — each rank prints its mesh coordinates.

Nothing in the library imports from here.  A new command that checks, measures or demonstrates
the library goes here.
"""
