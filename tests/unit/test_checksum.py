"""The raw-memory xxh3 the copy paths use is the xxh3-64 the xxhash package computes."""

import ctypes

import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvdepotd.storage.checksum import xxh3_at, xxh3_bytes


@given(st.binary(max_size=5000))
def test_matches_xxhash(data: bytes) -> None:
    assert xxh3_bytes(data) == xxhash.xxh3_64_intdigest(data)


def test_matches_xxhash_on_a_large_buffer_by_address() -> None:
    data = bytes(range(256)) * 8192 + b"tail"  # 2 MiB and a bit: the vector paths and the tail
    buf = ctypes.create_string_buffer(data, len(data))
    for n in (0, 1, 240, 241, 1 << 20, len(data)):
        assert xxh3_at(ctypes.addressof(buf), n) == xxhash.xxh3_64_intdigest(data[:n])
