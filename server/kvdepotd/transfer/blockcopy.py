"""The native block copy: one block between engine memory and the host arena in one C call, its
xxh3 taken in the same pass; or one layer of several blocks, each updating its own xxh3 state
(checksum.States), for a load copied layer by layer (kvdepotd/transfer/_blockcopy.c has the
contract).

`pip install .` builds it where a C compiler is, as it compiles the core (setup.py). An editable
install, and a machine without a compiler, run the copy engine's torch and ctypes paths instead:
the same bytes and checksums, more slowly (docs/performance.md).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvdepotd.storage.checksum import stream_functions

try:
    from kvdepotd.transfer import _blockcopy
except ImportError:  # not built: the copy engine's other paths serve
    _blockcopy = None  # type: ignore[assignment]

available = _blockcopy is not None
if available:
    _blockcopy.bind(*stream_functions())
    copy_block = _blockcopy.copy_block
    copy_blocks = _blockcopy.copy_blocks


def pack(runs: Sequence[tuple[int, int, int]]) -> bytes:
    """A block's runs as copy_block takes them: per run, the address of block 0, the stride from one
    block to the next and the length, in the order the runs lie in the host block."""
    return struct.pack(f"={3 * len(runs)}q", *(v for r in runs for v in r))


def int64s(values: Sequence[int]) -> bytes:
    """Block ids or addresses as copy_blocks takes them."""
    return struct.pack(f"={len(values)}q", *values)
