"""The remote store's value format against what a writer without the key can put under a key:
every crafted header is refused with a ValueError (never another exception, which would fail a
whole read job and leave the value in the store), a well-made header of another block is Forged,
and no value passes without the tag its contents give."""

from __future__ import annotations

import os
import struct

import pytest
import xxhash

from kvdepotd.storage import remote as fmt

KEYS = fmt.ValueKeys([b"k" * 40])
CLS, NS, N = "L2xH2xD8xfloat16xB16xW1", "tenant", 2048


def value(h: int = 7, parent: int | None = 3, ns: str = NS, cls: str = CLS, data: bytes = b"", keys: fmt.ValueKeys = KEYS) -> bytes:
    data = data or os.urandom(N)
    head = fmt.pack_header(1, N, h, parent, ns, cls, [xxhash.xxh3_64_intdigest(data)], keys.signing)
    buf = bytearray(head + bytes(fmt.TAG_BYTES) + data)
    fmt.seal(keys, ns, memoryview(buf))
    return bytes(buf)


def check(v: bytes, h: int = 7, parent: int | None = 3, ns: str = NS) -> None:
    length, _ = fmt.check_header(v, 1, N, h, parent, ns, CLS)
    fmt.verify(KEYS, ns, v, length, v[length:])


def rehash(head: bytearray) -> bytearray:
    """A crafted header with its own checksum made right (the checksum is not keyed)."""
    length = struct.unpack_from("<I", head, 12)[0]
    end = length - fmt.TAG_BYTES - 8
    struct.pack_into("<Q", head, end, xxhash.xxh3_64_intdigest(bytes(head[:end])))
    return head


def test_a_genuine_value_passes() -> None:
    check(value())


@pytest.mark.parametrize("cut", [0, 10, fmt._FIXED.size, fmt._FIXED.size + 8, 200])
def test_truncated_values_are_refused_with_a_value_error(cut: int) -> None:
    with pytest.raises(ValueError):
        check(value()[:cut])


def test_a_header_whose_lengths_point_past_the_value_is_refused_not_crashed_on() -> None:
    v = bytearray(value())
    length = struct.unpack_from("<I", v, 12)[0]
    struct.pack_into("<H", v, fmt._FIXED.size + 8, 0xFFFF)  # the namespace's length: past the header's end
    with pytest.raises(ValueError):
        check(bytes(rehash(v[:length])) + bytes(v[length:]))
    short = bytearray(v[: fmt._FIXED.size])  # a bare fixed part claiming a minimal header: no room for the names
    struct.pack_into("<I", short, 12, fmt._FIXED.size + 8 + 4 + 8 + fmt.TAG_BYTES)
    with pytest.raises(ValueError):
        check(bytes(short) + bytes(200))


@pytest.mark.parametrize("where", ["another block", "another parent", "another namespace"])
def test_a_genuine_value_under_another_key_is_forged(where: str) -> None:
    v = value(h=9) if where == "another block" else value(parent=4) if where == "another parent" else value(ns="other")
    with pytest.raises(fmt.Forged):
        check(v)


def test_data_changed_with_every_checksum_recomputed_fails_the_tag() -> None:
    v = bytearray(value())
    length = struct.unpack_from("<I", v, 12)[0]
    v[length:] = bytes(N)
    struct.pack_into("<Q", v, fmt._FIXED.size, xxhash.xxh3_64_intdigest(bytes(N)))  # rank 0's data checksum
    with pytest.raises(fmt.Forged, match="tag does not match"):
        check(bytes(rehash(v[:length])) + bytes(v[length:]))


def test_a_value_signed_with_another_key_is_refused_naming_its_id() -> None:
    other = fmt.ValueKeys([b"o" * 40])
    with pytest.raises(fmt.Forged, match=f"signed with key {other.ids[0]}"):
        check(value(keys=other))
    both = fmt.ValueKeys([b"k" * 40, b"o" * 40])  # a rotation: the second key is accepted too
    v = value(keys=other)
    length, _ = fmt.check_header(v, 1, N, 7, 3, NS, CLS)
    fmt.verify(both, NS, v, length, v[length:])
