"""xxh3-64 (seed 0) over raw memory, straight from the xxhash wheel's library.

A ctypes call releases the GIL, so copy and I/O threads checksum at once
(xxhash.xxh3_64_intdigest holds the GIL: half the speed with two threads). The wheel's
`_dispatch` entry points pick the widest vector unit the CPU has at run time (AVX2 here: about
twice the plain entry point's speed on data in cache); the result is the same xxh3 either way.
"""

from __future__ import annotations

import ctypes
import struct

import xxhash._xxhash

_lib = ctypes.CDLL(xxhash._xxhash.__file__)
xxh3_at = getattr(_lib, "XXH3_64bits_dispatch", None) or _lib.XXH3_64bits
xxh3_at.restype = ctypes.c_uint64
xxh3_at.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def xxh3_bytes(data: bytes) -> int:
    return int(xxh3_at(data, len(data)))


def stream_functions() -> tuple[int, int, int, int, int]:
    """Addresses of the library's streaming xxh3-64 functions, for native code that hashes as it
    copies: create_state, free_state, reset (seed 0), update, digest."""
    names = ("XXH3_createState", "XXH3_freeState", "XXH3_64bits_reset", "XXH3_64bits_update", "XXH3_64bits_digest")
    fns = [getattr(_lib, n) for n in names]
    fns[3] = getattr(_lib, "XXH3_64bits_update_dispatch", None) or fns[3]
    addrs = [ctypes.cast(f, ctypes.c_void_p).value or 0 for f in fns]
    return addrs[0], addrs[1], addrs[2], addrs[3], addrs[4]


for _name, _res, _args in (
    ("XXH3_createState", ctypes.c_void_p, []),
    ("XXH3_freeState", ctypes.c_int, [ctypes.c_void_p]),
    ("XXH3_64bits_reset", ctypes.c_int, [ctypes.c_void_p]),
    ("XXH3_64bits_digest", ctypes.c_uint64, [ctypes.c_void_p]),
):
    getattr(_lib, _name).restype, getattr(_lib, _name).argtypes = _res, _args


class States:
    """`n` streaming xxh3-64 states, reset, for native code that hashes blocks a piece at a time
    (blockcopy.copy_blocks): `addresses` packs them as int64; digest(i) is block i's checksum once
    all its bytes went in. close() frees them (idempotent)."""

    def __init__(self, n: int) -> None:
        self._states: list[int] = []
        for _ in range(n):
            st = _lib.XXH3_createState()
            if not st:
                self.close()
                raise MemoryError("xxh3 state")
            self._states.append(st)
            _lib.XXH3_64bits_reset(st)
        self.addresses = struct.pack(f"={n}q", *self._states)

    def digest(self, i: int) -> int:
        return int(_lib.XXH3_64bits_digest(self._states[i]))

    def close(self) -> None:
        states, self._states = self._states, []
        for st in states:
            _lib.XXH3_freeState(st)
