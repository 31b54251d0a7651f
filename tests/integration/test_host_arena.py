"""The host tier's memory is backed as copies write into it: nothing at first beyond the look-ahead,
a copy's bytes before it writes them and LOOKAHEAD beyond them in the background, everything on
prepare_all. A /dev/shm that cannot back a chunk fails that ensure(), saying so,
instead of a SIGBUS in a copy thread."""

from __future__ import annotations

import ctypes
import errno
import time

import pytest

from kvdepotd.storage import host_arena
from kvdepotd.storage.host_arena import CHUNK, LOOKAHEAD, ArenaError, HostArena


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


@pytest.mark.parametrize("kernel", ["populate", "zeroing"])
def test_a_chunk_that_cannot_be_backed_fails_ensure_with_the_reason(monkeypatch: pytest.MonkeyPatch, kernel: str) -> None:
    arena = HostArena(4 * CHUNK + LOOKAHEAD)
    try:
        assert backed_soon(arena, LOOKAHEAD)
        if kernel == "populate":
            monkeypatch.setattr(host_arena, "populate_write", lambda addr, n: errno.ENOMEM)
        else:
            class Unbacked:  # what torch raises when the memory behind a write is gone
                def narrow(self, *_: int) -> Unbacked:
                    return self

                def zero_(self) -> None:
                    raise RuntimeError("unable to write to file")

            monkeypatch.setattr(arena, "_populate", False)  # a kernel without MADV_POPULATE_WRITE
            monkeypatch.setattr(arena, "tensor", Unbacked())
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
