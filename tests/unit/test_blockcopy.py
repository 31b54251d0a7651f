"""The native block copy (kvdepotd.transfer._blockcopy, built by `pip install .`): every byte of a
block lands where its runs say, either way, and the checksum it takes on the way is the xxh3 of
the host block's bytes, whatever the runs' lengths and alignment. Skipped where it is not built
(an editable install); .ci/run runs these against the compiled build."""

from __future__ import annotations

import ctypes

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvdepotd.transfer import blockcopy

pytestmark = pytest.mark.skipif(not blockcopy.available, reason="the native block copy is built by `pip install .`, not by an editable install")

BLOCKS = 3


def engine_memory(lengths: list[int], skew: int) -> tuple[ctypes.Array[ctypes.c_char], list[tuple[int, int, int]]]:
    """One buffer holding, per run, BLOCKS blocks of it one after the other (a block stride of the
    run's length plus a gap), starting `skew` bytes off alignment; the runs' (address, stride, length)."""
    sizes = [BLOCKS * (n + 8) for n in lengths]
    buf = ctypes.create_string_buffer(bytes((i * 7 + 3) % 251 for i in range(sum(sizes) + skew)))
    runs, at = [], ctypes.addressof(buf) + skew
    for n, size in zip(lengths, sizes):
        runs.append((at, n + 8, n))
        at += size
    return buf, runs


def block_bytes(runs: list[tuple[int, int, int]], block: int) -> bytes:
    return b"".join(ctypes.string_at(addr + block * stride, n) for addr, stride, n in runs)


lengths = st.lists(st.integers(1, 70_000) | st.sampled_from([16, 64, 16 << 10, (16 << 10) + 1, 65536]), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(lengths=lengths, skew=st.integers(0, 15), host_skew=st.integers(0, 15), block=st.integers(0, BLOCKS - 1))
def test_a_block_goes_to_the_host_and_back_with_its_xxh3(lengths: list[int], skew: int, host_skew: int, block: int) -> None:
    buf, runs = engine_memory(lengths, skew)
    want = block_bytes(runs, block)
    host = ctypes.create_string_buffer(len(want) + host_skew)
    haddr = ctypes.addressof(host) + host_skew
    got = blockcopy.copy_block(blockcopy.pack(runs), block, haddr, True, True)
    assert ctypes.string_at(haddr, len(want)) == want
    assert got == xxhash.xxh3_64_intdigest(want)
    # Back into another block of the engine: the checksum is the host bytes' again.
    new = bytes((i * 13 + 1) % 256 for i in range(len(want)))
    ctypes.memmove(haddr, new, len(new))
    other = (block + 1) % BLOCKS
    neighbours = [block_bytes(runs, b) for b in range(BLOCKS) if b != other]
    assert blockcopy.copy_block(blockcopy.pack(runs), other, haddr, False, True) == xxhash.xxh3_64_intdigest(new)
    assert block_bytes(runs, other) == new
    assert [block_bytes(runs, b) for b in range(BLOCKS) if b != other] == neighbours  # nothing else touched
    assert blockcopy.copy_block(blockcopy.pack(runs), block, haddr, True, False) is None
    assert ctypes.string_at(haddr, len(want)) == want
    del buf


def test_bad_arguments_raise_and_copy_nothing() -> None:
    buf, runs = engine_memory([64], 0)
    host = ctypes.create_string_buffer(64)
    with pytest.raises(TypeError, match="int64 triples"):
        blockcopy.copy_block(blockcopy.pack(runs)[:-1], 0, ctypes.addressof(host), True, True)
    with pytest.raises(ValueError, match="negative block"):
        blockcopy.copy_block(blockcopy.pack(runs), -1, ctypes.addressof(host), True, True)
    with pytest.raises(TypeError):
        blockcopy.copy_block(blockcopy.pack(runs), 0, ctypes.addressof(host), True)  # type: ignore[call-arg]
    assert host.raw == bytes(64)
    del buf


def test_memory_shrunk_under_a_copy_raises_instead_of_killing_the_process() -> None:
    """A mapping of a file its owner truncated: touching it is SIGBUS. The copy raises OSError
    (EFAULT) either way, then copies as before; a SIGBUS outside a copy is not caught."""
    import errno
    import mmap
    import os
    import signal
    import subprocess
    import sys

    fd = os.memfd_create("shrinks")
    os.ftruncate(fd, 4 * mmap.PAGESIZE)
    mm = mmap.mmap(fd, 4 * mmap.PAGESIZE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    runs = blockcopy.pack([(addr, mmap.PAGESIZE, mmap.PAGESIZE)])
    host = ctypes.create_string_buffer(mmap.PAGESIZE)
    assert blockcopy.copy_block(runs, 3, ctypes.addressof(host), True, True) is not None
    os.ftruncate(fd, mmap.PAGESIZE)  # blocks 1..3 are gone
    for to_host in (True, False):
        with pytest.raises(OSError) as e:
            blockcopy.copy_block(runs, 2, ctypes.addressof(host), to_host, True)
        assert e.value.errno == errno.EFAULT and "SIGBUS caught" in str(e.value)
    assert blockcopy.copy_block(runs, 0, ctypes.addressof(host), True, True) is not None  # block 0 is still there
    mm.close()
    os.close(fd)
    outside = (  # the same fault outside a copy: the process dies of it as without the module
        "import ctypes, mmap, os; from kvdepotd.transfer import blockcopy; fd = os.memfd_create('x'); os.ftruncate(fd, 8192); "
        "mm = mmap.mmap(fd, 8192); a = ctypes.addressof(ctypes.c_char.from_buffer(mm)); os.ftruncate(fd, 0); ctypes.string_at(a + 4096, 8)"
    )
    assert subprocess.run([sys.executable, "-c", outside], env=os.environ, capture_output=True).returncode == -signal.SIGBUS


@settings(max_examples=40, deadline=None)
@given(lengths=lengths, layers=st.integers(1, 5), skew=st.integers(0, 15))
def test_blocks_copied_layer_by_layer_land_whole_with_their_xxh3(lengths: list[int], layers: int, skew: int) -> None:
    """A load copied layer by layer (copy_blocks over each layer's runs, layer 0 of every block
    first) puts every block's bytes where a whole-block copy does, and the states it fed, one per
    block, end as each block's xxh3: whatever the runs' lengths, and however the layers cut them."""
    from kvdepotd.storage.checksum import States
    from kvdepotd.transfer.mapping import Run, layer_runs

    lengths = [n * layers for n in lengths]  # a block is `layers` equal slices
    buf, runs = engine_memory(lengths, skew)
    size = sum(lengths)
    host = ctypes.create_string_buffer(BLOCKS * size)
    for b in range(BLOCKS):  # the host tier's blocks, each different
        ctypes.memmove(ctypes.addressof(host) + b * size, bytes((b * 17 + i * 5 + 1) % 256 for i in range(size)), size)
    want = [ctypes.string_at(ctypes.addressof(host) + b * size, size) for b in range(BLOCKS)]
    at, mapped = 0, []
    for addr, stride, n in runs:
        mapped.append(Run(addr, stride, n, at, 0, 0))
        at += n
    per_layer = layer_runs(mapped, layers)
    assert [sum(r[2] for r in lr) for lr in per_layer] == [size // layers] * layers
    states = States(BLOCKS)
    try:
        order = list(range(BLOCKS))[::-1]  # engine block b takes host block BLOCKS-1-b
        for layer, lr in enumerate(per_layer):
            hosts = [ctypes.addressof(host) + (BLOCKS - 1 - b) * size + layer * (size // layers) for b in order]
            blockcopy.copy_blocks(blockcopy.pack(lr), blockcopy.int64s(order), blockcopy.int64s(hosts), False, states.addresses)
            if layer < layers - 1:  # the layers not copied yet are still the engine's old bytes
                assert block_bytes(runs, order[0])[(layer + 1) * (size // layers) :] != want[BLOCKS - 1 - order[0]][(layer + 1) * (size // layers) :]
        for i, b in enumerate(order):
            assert block_bytes(runs, b) == want[BLOCKS - 1 - b]
            assert states.digest(i) == xxhash.xxh3_64_intdigest(want[BLOCKS - 1 - b])
    finally:
        states.close()
    del buf


def test_copy_blocks_refuses_bad_arguments() -> None:
    buf, runs = engine_memory([64], 0)
    host = ctypes.create_string_buffer(64)
    one = blockcopy.int64s([ctypes.addressof(host)])
    with pytest.raises(ValueError, match="one per block"):
        blockcopy.copy_blocks(blockcopy.pack(runs), blockcopy.int64s([0, 1]), one, True, b"")
    with pytest.raises(ValueError, match="negative block"):
        blockcopy.copy_blocks(blockcopy.pack(runs), blockcopy.int64s([-1]), one, True, b"")
    with pytest.raises(TypeError, match="int64"):
        blockcopy.copy_blocks(blockcopy.pack(runs), b"123", one, True, b"")
    assert host.raw == bytes(64)
    del buf
