"""The per-variable chunk read of ``ERA5Dataset``: tensorstore's zarr3 driver, or zarr itself.

One call reads one variable's window (times, the rank's rows, its levels) straight into its
channels of the sample buffer.  Two readers do that, bit-identically:

* ``tensorstore`` (the default when importable): the store's arrays opened with tensorstore's
  ``zarr3`` driver over the local file system, read into the buffer by ``ts.array(view).write``.
  It reads 1.8-2.9x more MB per CPU second than zarr on the 16-rows-per-chunk layout
  (docs/data.md, "Reader choice").  It takes local zarr v3 stores whose arrays are plain
  (unsharded) chunks; anything else falls back to zarr under ``data.reader: auto``.
* ``zarr``: ``Array.get_basic_selection`` / ``get_orthogonal_selection`` with ``out=``, through
  the ``ByteCountingStore`` (the reference, and the fallback).

Byte accounting: tensorstore does not read through ``ByteCountingStore``, so this module counts
its chunks from the read's plan: the chunks of the chunk grid the selection touches (exactly the
chunks zarr would fetch), each counted with its stored size (the chunk file's size; a chunk that
was never written is not counted, as zarr does not count it).  ``chunk_reads`` / ``chunk_bytes``
thus mean the same under both readers; tests/test_data_reads.py checks them under both.

Fork: tensorstore runs thread pools, and a process forked from one that has used tensorstore
aborts as soon as it uses tensorstore itself ("fork() use detected").  So handles are opened
lazily in the process that reads (never before DataLoader workers fork), and a forked process
whose parent had already used tensorstore reads through zarr instead (the same bytes, bit for
bit; ``tensorstore_usable()``).  Workers forked from a main process that has read no sample
through tensorstore read through tensorstore; after a main-process tensorstore read (a cached
dataset's one read, a ``num_workers: 0`` loader, a probe sample) the workers forked later read
through zarr.
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
from zarr.core.buffer.cpu import NDBuffer

__all__ = [
    "READERS",
    "ChunkReader",
    "choose_reader",
    "tensorstore_available",
    "tensorstore_usable",
]

READERS = ("auto", "tensorstore", "zarr")

# the process that started tensorstore's threads; a forked child inherits the value
_started_in: int | None = None


def tensorstore_usable() -> bool:
    """False in a process forked from one that had used tensorstore (it would abort)."""
    return _started_in is None or _started_in == os.getpid()


def tensorstore_available() -> bool:
    try:
        import tensorstore  # noqa: F401
    except ImportError:
        return False
    return True


def _tensorstore_obstacle(path: Path, arrays: dict) -> str | None:
    """Why tensorstore cannot read the arrays of the store at ``path``, or None when it can."""
    if not tensorstore_available():
        return "tensorstore is not importable (pip install 'tensorstore>=0.1.86')"
    try:
        root = json.loads((path / "zarr.json").read_text())
    except (OSError, ValueError):
        return f"{str(path)!r} is not a local zarr v3 store (no readable zarr.json)"
    if root.get("zarr_format") != 3:
        return f"{str(path)!r} is zarr format {root.get('zarr_format')}, not 3"
    for name, array in arrays.items():
        if array.shards is not None:
            return f"array {name!r} is sharded"
    return None


def choose_reader(reader: str, path: Path, arrays: dict) -> str:
    """``"tensorstore"`` or ``"zarr"`` for ``data.reader`` = ``reader`` on the store at ``path``
    whose direct-read zarr ``arrays`` are given; ``"tensorstore"`` on a store it cannot open is
    an error naming the key."""
    if reader not in READERS:
        raise ValueError(f"data.reader must be one of {list(READERS)}, got {reader!r}")
    if reader == "zarr" or not arrays:
        return "zarr"
    obstacle = _tensorstore_obstacle(path, arrays)
    if obstacle is None:
        return "tensorstore"
    if reader == "tensorstore":
        raise ValueError(
            f"data.reader: tensorstore cannot read this store: {obstacle}; "
            "set data.reader: zarr (or auto, which falls back to zarr)"
        )
    return "zarr"


def _chunk_coords(index, chunk: int):
    """The chunk indices a 1-D selection (slice or integer array) touches along one dim."""
    if isinstance(index, slice):
        index = np.arange(index.start, index.stop, index.step or 1)
    return np.unique(np.asarray(index) // chunk).tolist()


class ChunkReader:
    """Reads one variable's selection into a buffer view with the chosen ``kind`` of reader.

    ``arrays``: the zarr arrays (name -> ``zarr.Array``) of the variables read directly;
    ``counter``: the ``ByteCountingStore`` they read through, where tensorstore's chunks are
    counted too.
    """

    def __init__(self, kind: str, path: Path, arrays: dict, counter) -> None:
        self.kind = kind
        self.path = Path(path)
        self.arrays = arrays
        self.counter = counter
        self._handles: dict = {}
        self._pid = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_handles"], state["_pid"] = {}, None  # reopened where it is unpickled
        return state

    def release(self) -> None:
        """Drop the zarr arrays and tensorstore handles (after a cached dataset's one read)."""
        self.arrays, self._handles, self._pid = {}, {}, None

    def read(self, name: str, selection: tuple, basic: bool, view: np.ndarray) -> None:
        """Array ``name`` at ``selection`` (slices, and an integer array for the levels when
        not ``basic``) decoded into ``view``, which has the selection's shape."""
        if self.kind == "zarr" or not tensorstore_usable():
            array = self.arrays[name]
            get = array.get_basic_selection if basic else array.get_orthogonal_selection
            get(selection, out=NDBuffer.from_numpy_array(view))
            return
        import tensorstore as ts

        handle = self._handle(name)
        source = handle[selection] if basic else handle.oindex[selection]
        ts.array(view).write(source).result()
        self._count(name, selection)

    def _handle(self, name: str):
        import tensorstore as ts

        global _started_in
        _started_in = os.getpid()
        if self._pid != os.getpid():  # first read in this process, or a forked worker
            self._handles, self._pid = {}, os.getpid()
        if name not in self._handles:
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(self.path / name)}}
            self._handles[name] = ts.open(spec, read=True).result()
        return self._handles[name]

    def _count(self, name: str, selection: tuple) -> None:
        """Count the chunks of ``name`` the selection touches, with their stored sizes."""
        array = self.arrays[name]
        full = tuple(selection) + (slice(None),) * (array.ndim - len(selection))
        per_dim = [
            _chunk_coords(slice(*index.indices(size)) if isinstance(index, slice) else index, c)
            for index, size, c in zip(full, array.shape, array.chunks)
        ]
        encode = array.metadata.chunk_key_encoding.encode_chunk_key
        for coords in itertools.product(*per_dim):
            try:
                size = os.stat(self.path / name / encode(coords)).st_size
            except FileNotFoundError:
                continue
            self.counter.add_chunk(name, size)
