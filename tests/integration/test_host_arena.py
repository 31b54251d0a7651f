"""The host tier's memory is backed as copies write into it: nothing at first beyond the look-ahead,
a copy's bytes before it writes them and LOOKAHEAD beyond them in the background, everything on
prepare_all. A /dev/shm that cannot back a chunk fails that ensure(), saying so,
instead of a SIGBUS in a copy thread."""

from __future__ import annotations

import ctypes
import errno
import os
import subprocess
import sys
import threading
import time

import pytest

from kvdepotd.storage import host_arena
from kvdepotd.storage.host_arena import CHUNK, LOOKAHEAD, ArenaError, HostArena
from kvdepotd.storage.lazy_torch import NVIDIA_DEVICE


def backed_soon(arena: HostArena, nbytes: int) -> bool:
    end = time.monotonic() + 10
    while arena.ready_bytes < nbytes and time.monotonic() < end:
        time.sleep(0.01)
    return arena.ready_bytes >= nbytes


def test_backed_ahead_of_the_writes() -> None:
    arena = HostArena(8 * CHUNK + LOOKAHEAD)
    try:
        assert backed_soon(arena, LOOKAHEAD)
        time.sleep(0.1)
        assert arena.ready_bytes == LOOKAHEAD  # no further than asked
        assert arena.ensure(3 * CHUNK)  # a copy about to write up to there: backed now, and more soon
        assert arena.ready_bytes >= 3 * CHUNK and backed_soon(arena, 3 * CHUNK + LOOKAHEAD)
        assert arena.ensure(arena.total_bytes - 1) and arena.ready_bytes == arena.total_bytes
        ctypes.memset(arena.base + arena.total_bytes - 4096, 7, 4096)  # writable to the end
    finally:
        arena.close()


def test_prepare_all_backs_everything_and_keeps_what_was_written() -> None:
    arena = HostArena(3 * CHUNK + 4096)
    try:
        assert arena.ensure(100)
        ctypes.memset(arena.base, 0x5A, 100)
        arena.prepare_all()
        assert arena.ready_bytes == arena.total_bytes
        assert ctypes.string_at(arena.base, 100) == b"\x5a" * 100  # backing never writes
    finally:
        arena.close()


@pytest.mark.parametrize("kernel", ["populate", "fallocate"])
def test_a_chunk_that_cannot_be_backed_fails_ensure_with_the_reason(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    arena = HostArena(4 * CHUNK + LOOKAHEAD)
    try:
        assert backed_soon(arena, LOOKAHEAD)
        if kernel == "populate":
            monkeypatch.setattr(host_arena, "populate_write", lambda addr, n: errno.ENOMEM)
        else:
            monkeypatch.setattr(arena, "_populate", False)  # a kernel without MADV_POPULATE_WRITE
            monkeypatch.setattr(host_arena, "allocate", lambda fd, off, n: errno.ENOSPC)  # /dev/shm is full
        assert arena.ensure(LOOKAHEAD)  # what is backed stays usable
        assert not arena.ensure(arena.total_bytes)
        assert "could not back" in arena.error and "GiB" in arena.error
        with pytest.raises(ArenaError, match="could not back"):
            arena.prepare_all()
    finally:
        arena.close()


def test_an_empty_tier_has_no_thread() -> None:
    arena = HostArena(0)
    assert arena.ensure(0) and arena.ready_bytes == 0
    arena.close()
    assert host_arena.LOOKAHEAD > 0


def test_a_kernel_without_populate_write_backs_by_allocating_the_file(monkeypatch: pytest.MonkeyPatch) -> None:
    arena = HostArena(2 * CHUNK + LOOKAHEAD)
    try:
        monkeypatch.setattr(arena, "_populate", False)
        assert arena.ensure(arena.total_bytes) and not arena.error
        assert os.fstat(arena._file).st_blocks * 512 >= arena.total_bytes  # every byte reserved in the file
        ctypes.memset(arena.base + arena.total_bytes - 4096, 7, 4096)
        assert ctypes.string_at(arena.base, 16) == bytes(16)
    finally:
        arena.close()


def test_the_daemon_starts_without_torch() -> None:
    """torch is imported when an engine maps memory (or a GPU is there to pin for), not at start:
    it was most of the start's second."""
    if os.path.exists(NVIDIA_DEVICE):
        pytest.skip("a GPU machine: the host tier is pinned, with torch, from the start")
    code = (
        "import sys; import kvdepotd.server; from kvdepotd.storage.host_arena import HostArena; "
        "a = HostArena(1 << 24); a.ensure(1 << 20); a.close(); "
        "assert 'torch' not in sys.modules, 'torch imported at start'; "
        "from kvdepotd.storage.lazy_torch import torch; t = torch(); assert t.get_num_threads() == 1"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_a_copy_never_waits_for_the_backing_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backing thread runs at a lower priority: an engine busy on every core may hold it off.
    A copy backs what it needs itself meanwhile, instead of waiting for that thread (here stuck
    for 10 s inside its piece)."""
    gate = threading.Event()
    real = host_arena.populate_write

    def stuck_in_the_thread(addr: int, n: int) -> int:
        if threading.current_thread().name.startswith("kvdepot-arena"):
            gate.wait(10)
        return real(addr, n)

    monkeypatch.setattr(host_arena, "populate_write", stuck_in_the_thread)
    arena = HostArena(4 * CHUNK)
    try:
        t0 = time.monotonic()
        assert arena.ensure(2 * CHUNK) and arena.ready_bytes >= 2 * CHUNK
        assert time.monotonic() - t0 < 5, "the copy waited for the backing thread"
        ctypes.memset(arena.base + 2 * CHUNK - 4096, 1, 4096)
    finally:
        gate.set()
        arena.close()
    assert arena.ready_bytes <= arena.total_bytes
