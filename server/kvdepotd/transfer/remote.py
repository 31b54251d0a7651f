"""The remote copy engine: host arena <-> the remote store, on its own thread pool.

    submit(jobs)             RemoteJobs from the Depot; returns at once
    on_done                  (job id, failed, corrupt, present, message, forged), called on the event loop
    held(keys, budget_ms)    how many leading keys the store holds, asked within a budget (a
                             lookup's thread; growing batches, stopping at the first missing key)
    close()                  waits for running jobs

  write   one batch asks which blocks the store holds already (another daemon wrote them: not
          sent again), more set the others, SEND_BYTES at a time, each sent while the next values
          are made. A value is the header (with the checksums the
          host tier took when the block left the engine), the block's bytes, and the tag (a MAC
          with the namespace's key) over both.
  read    one batch gets the values; each is checked (every header field, then the tag over the
          header and the data, after it was copied into the host cell it is staged in; a value
          whose tag fails is told corrupt or forged by its data's checksums) before it is
          reported. A corrupt or forged value is deleted from the store. The report comes only
          after the client returned: nothing writes into a host cell after the core may reuse it.
A key that fails (missing, evicted, its node down, the request's timeout) fails that block alone;
the load it was for recomputes it. No job takes longer than the store's request timeout: a batch
that timed out is not asked again key by key.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import mmap
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

from kvdepotd.core.remote import RemoteJob, RemoteJobKind
from kvdepotd.storage.checksum import xxh3_at
from kvdepotd.core.disk import public_class
from kvdepotd.storage.host_arena import Arenas
from kvdepotd.storage.remote import TAG_BYTES, Forged, RemoteStore, ValueKeys, block_key, check_header, header_bytes, pack_header, seal, verify

log = logging.getLogger("kvdepotd")
DoneFn = Callable[[int, set[int], set[int], set[int], str, set[int]], None]
Result = tuple[set[int], set[int], set[int], str, set[int]]  # failed, corrupt, present, message, forged (within corrupt)
LOOKUP_FIRST = 128  # keys in a lookup's first batch; each next one is 4 times larger
READ_THREADS = 8  # read jobs at once (a load of 8 jobs of 16 blocks: a 4096-token prompt of 32-token blocks)
SEND_BYTES = 8 << 20  # a write job's values are sent this many bytes at a time, the next made meanwhile
QUARANTINE_BYTES = 256 << 20  # scratch memory set aside after failed calls before buffered calls stop


def timed_out(e: object) -> bool:
    """The store's client gave up waiting (glide's TimeoutError, or ours)."""
    return isinstance(e, TimeoutError) or "timeout" in type(e).__name__.lower() or "timed out" in str(e).lower()


class Skipped(TimeoutError):
    """Keys not asked for: their node timed out a moment ago (RemoteStore.silent)."""


def detached(e: Exception) -> Exception:
    """What a raised client error says, without its traceback: the client's frames hold the
    buffers the call exported (a cycle through them, collected later, crashed the collector)."""
    return (TimeoutError if timed_out(e) else ConnectionError)(f"{type(e).__name__}: {e}")


def address_of(value: bytes | memoryview) -> int:
    """Where a value's bytes are (the bytes object's own buffer, or the memory a view is on)."""
    if isinstance(value, memoryview):
        return ctypes.addressof(ctypes.c_char.from_buffer(value))
    return ctypes.cast(ctypes.c_char_p(value), ctypes.c_void_p).value or 0


class Scratch:
    """One thread's reusable memory for store values: an anonymous mapping, so that making it
    costs nothing under the GIL (a bytearray is zeroed, page by page, with the GIL held: on the
    first remote load that kept the event loop from answering the Step in time). Memory that a
    failed call was given is set aside for good (a client that gave up on a call might still write
    into, or read, it later); past QUARANTINE_BYTES of that, values go through the client's own
    allocations instead."""

    quarantined: list[mmap.mmap] = []
    quarantined_bytes = 0
    _lock = threading.Lock()

    def __init__(self) -> None:
        self.buf: mmap.mmap | None = None

    def views(self, sizes: list[int]) -> tuple[list[memoryview], list[int]]:
        total = sum(sizes)
        if not total:
            return [], []
        if self.buf is None or len(self.buf) < total:
            self.buf = mmap.mmap(-1, total)  # the old one goes once no view of it is left
        mv = memoryview(self.buf)
        base = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        views, addrs, off = [], [], 0
        for n in sizes:
            views.append(mv[off : off + n])
            addrs.append(base + off)
            off += n
        return views, addrs

    def quarantine(self) -> None:
        if self.buf is None:
            return
        with Scratch._lock:
            Scratch.quarantined.append(self.buf)
            Scratch.quarantined_bytes += len(self.buf)
        self.buf = None

    @staticmethod
    def usable() -> bool:
        return Scratch.quarantined_bytes < QUARANTINE_BYTES


class RemoteCopyEngine:
    def __init__(
        self,
        on_done: DoneFn,
        arenas: Arenas,
        store: RemoteStore,
        threads: int = 2,
        observe: Callable[[str, int, float], None] | None = None,
        note: Callable[[str, int], None] | None = None,
    ) -> None:
        self.on_done = on_done
        self.arenas = arenas
        self.store = store
        self.observe = observe or (lambda kind, nbytes, seconds: None)
        self.note = note or (lambda what, n: None)  # failures by kind: timeout, error, missing, corrupt
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvdepot-remote")  # writes
        self._senders = ThreadPoolExecutor(threads, thread_name_prefix="kvdepot-remote-send")  # a write's SETs, piece by piece
        # Reads wait on the store most of their time (the copies and checks let go of the GIL): a
        # load's jobs all start at once, rather than one waiting out another's timeout.
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kvdepot-remote-read")
        self._fanout = ThreadPoolExecutor(2 * READ_THREADS, thread_name_prefix="kvdepot-remote-node")  # a job's other primaries
        self._local = threading.local()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def submit(self, jobs: list[RemoteJob]) -> None:
        if not jobs:
            return
        if self._closed:
            for job in jobs:
                self.on_done(job.job_id, {it.hash for it in job.items}, set(), set(), "the daemon is shutting down", set())
            return
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        loop = self._loop
        for job in jobs:

            def finished(fut: Future[Result], job: RemoteJob = job) -> None:
                loop.call_soon_threadsafe(self._done, job, fut)

            if job.kind is RemoteJobKind.WRITE:
                self._pool.submit(self._write, job).add_done_callback(finished)
            else:
                self._readers.submit(self._read, job).add_done_callback(finished)

    def _done(self, job: RemoteJob, fut: Future[Result]) -> None:
        try:
            failed, corrupt, present, message, forged = fut.result()
        except Exception as e:  # a bug or an error we did not expect: the job's blocks fail
            log.exception("remote %s job %d failed", job.kind.value.lower(), job.job_id)
            failed, corrupt, present, message, forged = {it.hash for it in job.items}, set(), set(), f"remote store: {e}", set()
        self.on_done(job.job_id, failed, corrupt, present, message, forged)

    def _keys(self, job: RemoteJob) -> list[bytes]:
        prefix = self.store.settings.prefix
        return [block_key(prefix, it.owner, public_class(job.layout_class), it.hash) for it in job.items]

    def _failures(self, results: Sequence[object]) -> None:
        errors = [r for r in results if isinstance(r, Exception)]
        if errors:
            timeouts = sum(1 for r in errors if timed_out(r))
            self.note("timeout", timeouts)
            self.note("error", len(errors) - timeouts)

    # -- the jobs (remote threads) ----------------------------------------------------------------
    def _write(self, job: RemoteJob) -> Result:
        t0 = time.perf_counter()
        keys = self._keys(job)
        try:
            held = self.store.exists(keys)
        except Exception as e:
            self.note("timeout" if timed_out(e) else "error", len(keys))
            return {it.hash for it in job.items}, set(), set(), f"remote store: {e}", set()
        self._failures(held)
        present: set[int] = {it.hash for it, h in zip(job.items, held) if h is True}
        failed: set[int] = {it.hash for it, h in zip(job.items, held) if isinstance(h, Exception)}
        arena, cls, pub, ws, nbytes = self.arenas.of(job.layout_class), job.layout_class, public_class(job.layout_class), job.world_size, job.block_bytes
        rank_bytes = nbytes // ws
        keyring = self._keyring()
        items = [(it, key) for it, key in zip(job.items, keys) if it.hash not in present and it.hash not in failed]
        scratch = self._scratch() if Scratch.usable() else Scratch()  # past the quarantine's bound: fresh memory each job
        views, addrs = scratch.views([header_bytes(ws, it.owner, pub) + nbytes for it, _ in items])
        # Values are made a piece at a time, each piece's SET sent (on a sender thread, the client
        # and the copy and MAC all let go of the GIL) while the next one is made.
        sends: list[tuple[list[int], Future[tuple[list[Exception | None], bool]]]] = []
        piece: list[tuple[bytes, memoryview]] = []
        hashes: list[int] = []
        try:
            for n, ((it, key), view, dst) in enumerate(zip(items, views, addrs), 1):
                addr = arena.base + it.host_offset
                sums = [arena.checksums.get((cls, it.host_cell, r)) for r in range(ws)]
                sums2 = [s if s is not None else int(xxh3_at(addr + r * rank_bytes, rank_bytes)) for r, s in enumerate(sums)]
                head = pack_header(ws, nbytes, it.hash, it.parent, it.owner, pub, sums2, keyring.signing)
                view[: len(head)] = head
                ctypes.memmove(dst + len(head) + TAG_BYTES, addr, nbytes)
                seal(keyring, it.owner, view)
                piece.append((key, view))
                hashes.append(it.hash)
                if len(piece) * nbytes >= SEND_BYTES or n == len(items):
                    sends.append((hashes, self._senders.submit(self._set, piece)))
                    piece, hashes = [], []
        finally:
            wait([f for _, f in sends])  # no send may still read this thread's scratch once the job ends
            if any(raised or any(r is not None and timed_out(r) for r in results) for results, raised in (f.result() for _, f in sends)):
                scratch.quarantine()  # a call, or a node's part, gave up while its bytes may still be sent: never written again
            # (a key refused with an answer, a full store's OOM say, was sent whole: the buffer is free)
        message, bad, sent = "", [], 0
        for hs, fut in sends:
            results, _ = fut.result()
            self._failures(results)
            sent += len(hs)
            for h, r in zip(hs, results):
                if r is not None:
                    bad.append(h)
                    message = message or f"remote store: {r}"
        failed.update(bad)
        self.observe("write", (sent - len(bad)) * job.block_bytes, time.perf_counter() - t0)
        return failed, set(), present, message, set()

    def _read(self, job: RemoteJob) -> Result:
        t0 = time.perf_counter()
        keys = self._keys(job)
        arena, cls, pub, ws, nbytes = self.arenas.of(job.layout_class), job.layout_class, public_class(job.layout_class), job.world_size, job.block_bytes
        if not arena.ensure(max(it.host_offset for it in job.items) + nbytes):
            return {it.hash for it in job.items}, set(), set(), arena.error, set()
        keyring = self._keyring()
        values = self._get(job, keys)
        self._failures(values)
        failed: set[int] = set()
        corrupt: set[int] = set()
        forged: set[int] = set()
        bad_keys: list[bytes] = []
        reasons: list[str] = []
        rank_bytes = nbytes // ws
        for it, key, value in zip(job.items, keys, values):
            if not isinstance(value, (bytes, memoryview)):
                failed.add(it.hash)
                if value is None:
                    self.note("missing", 1)
                    reasons.append("not in the remote store (evicted or never written)")
                else:
                    reasons.append(f"remote store: {value}")
                continue
            try:
                length, sums = check_header(value, ws, nbytes, it.hash, it.parent, it.owner, pub)
            except ValueError as e:  # Forged among them: a well-made header of another block
                corrupt.add(it.hash)
                bad_keys.append(key)
                if isinstance(e, Forged):
                    forged.add(it.hash)
                    reasons.append(f"block in the remote store refused: {e}")
                else:
                    reasons.append(f"corrupt block in the remote store: {e}")
                continue
            dst = arena.base + it.host_offset
            ctypes.memmove(dst, address_of(value) + length, nbytes)
            try:  # the tag covers the header (the checksums in it) and the data: one pass checks both
                verify(keyring, it.owner, value, length, memoryview((ctypes.c_ubyte * nbytes).from_address(dst)).cast("B"))
            except Forged as e:
                corrupt.add(it.hash)
                bad_keys.append(key)
                # An accident (a flipped bit, a torn value) fails the tag too: the checksums tell it
                # from a writer without the key, and are computed only then.
                if any(int(xxh3_at(dst + r * rank_bytes, rank_bytes)) != s for r, s in enumerate(sums)):
                    reasons.append("corrupt block in the remote store: data checksum mismatch")
                else:
                    forged.add(it.hash)
                    reasons.append(f"block in the remote store refused: {e}")
                continue
            for r, s in enumerate(sums):
                arena.checksums[(cls, it.host_cell, r)] = s
        if corrupt:
            self.note("corrupt", len(corrupt) - len(forged))
            self.note("forged", len(forged))
            try:
                self.store.delete(bad_keys)
            except Exception:
                pass  # the next reader finds it corrupt too
        self.observe("read", (len(job.items) - len(failed) - len(corrupt)) * nbytes, time.perf_counter() - t0)
        return failed, corrupt, set(), reasons[0] if reasons else "", forged

    def _set(self, items: list[tuple[bytes, memoryview]]) -> tuple[list[Exception | None], bool]:
        """Per key None or the error, and whether the call raised (gave up as a whole)."""
        try:
            return self.store.set(items), False
        except Exception as e:
            return [detached(e)] * len(items), True

    def _scratch(self) -> Scratch:
        s: Scratch | None = getattr(self._local, "scratch", None)
        if s is None:
            s = self._local.scratch = Scratch()
        return s

    def _keyring(self) -> ValueKeys:
        keys = self.store.settings.keys
        if keys is None:
            raise RuntimeError("the remote tier has no key (remote_key_file)")
        return keys

    def _get(self, job: RemoteJob, keys: list[bytes]) -> list[bytes | memoryview | None | Exception]:
        """The job's values: one MGET per primary that serves some of them, the primaries at once,
        into this thread's scratch memory (no allocation per value, which costs more than the
        copy). A primary that does not answer in time fails its own keys alone, within one request
        timeout; one whose MGET failed otherwise is asked again with a GET per key, within what is
        left of that timeout (a timed-out call is never repeated: it would double the wait)."""
        end = time.monotonic() + self.store.settings.timeout_ms / 1000
        out: list[bytes | memoryview | None | Exception] = [None] * len(keys)
        retry = list(range(len(keys)))
        if Scratch.usable():
            scratch = self._scratch()
            views, _ = scratch.views([header_bytes(job.world_size, it.owner, public_class(job.layout_class)) + job.block_bytes for it in job.items])

            def mget(node: str, idx: list[int]) -> list[memoryview | None] | Exception:
                if self.store.silent(node):
                    return Skipped(f"primary {node or 'of the store'} did not answer its last request in time")
                try:
                    got = self.store.get_into([keys[i] for i in idx], [views[i] for i in idx])
                except Exception as e:
                    if timed_out(e):
                        self.store.timed_out(node)
                    return detached(e)
                return [None if n is None else views[i][:n] for i, n in zip(idx, got)]

            groups = self.store.by_node(keys)
            others = [self._fanout.submit(mget, node, idx) for node, idx in list(groups.items())[1:]]
            answers = [mget(*next(iter(groups.items()))), *(f.result() for f in others)]
            retry = []
            for idx, got in zip(groups.values(), answers):
                if isinstance(got, Exception):
                    if timed_out(got):
                        for i in idx:
                            out[i] = got
                    else:
                        retry += idx
                else:
                    for i, view in zip(idx, got):
                        out[i] = view
            if any(isinstance(got, Exception) and not isinstance(got, Skipped) for got in answers):
                scratch.quarantine()  # a failed call may still write into it: never reused (the views stay valid)
        if retry:
            left = int((end - time.monotonic()) * 1000)
            try:
                if left <= 0:
                    raise TimeoutError("the remote store's request timeout passed")
                got_each: list[bytes | None | Exception] = list(self.store.get([keys[i] for i in retry], timeout_ms=left))
            except Exception as e:
                got_each = [detached(e)] * len(retry)
            for i, v in zip(retry, got_each):
                out[i] = v
        return out

    # -- lookups ---------------------------------------------------------------------------------------
    def held(self, namespace: str, layout_class: str, hashes: Sequence[int], budget_ms: int) -> int:
        """How many leading blocks of `hashes` the store holds, asked in growing batches within the
        budget (a key not answered in time counts as missing). Keys are made here, batch by batch,
        not on the event loop."""
        end = time.monotonic() + budget_ms / 1000
        prefix = self.store.settings.prefix
        found, n = 0, LOOKUP_FIRST
        while found < len(hashes):
            left = int((end - time.monotonic()) * 1000)
            if left <= 0:
                self.note("lookup_timeout", 1)
                return found
            batch = [block_key(prefix, namespace, public_class(layout_class), h) for h in hashes[found : found + n]]
            try:
                got = self.store.exists(batch, timeout_ms=left)
            except Exception as e:
                self.note("lookup_timeout" if "timeout" in type(e).__name__.lower() else "error", 1)
                return found
            for r in got:
                if r is not True:
                    if isinstance(r, Exception):
                        self._failures([r])
                    return found
                found += 1
            n *= 4
        return found

    async def close(self) -> None:
        self._closed = True
        await asyncio.to_thread(self._pool.shutdown, wait=True)
        self._senders.shutdown(wait=False)  # idle: every write waited for its sends
        await asyncio.to_thread(self._readers.shutdown, wait=True)
        self._fanout.shutdown(wait=False)
