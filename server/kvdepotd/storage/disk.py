"""One layout class's files in the disk tier: slab files, a journal, recovery (the directory that
holds every class, its lock and check-disk's verify are kvdepotd.storage.disk_dir).

    <disk-dir>/<layout class>/meta.json        what the files hold (record size, blocks per slab)
    <disk-dir>/<layout class>/slab-00000.kv    preallocated; cell k of the class lives in slab
                                               k // blocks_per_slab at record k % blocks_per_slab
    <disk-dir>/<layout class>/journal          fixed-size ADD / REMOVE records, each checksummed

One record on disk = a 4 KiB header (magic, generation, hash, parent, per-rank xxh3 of the data,
the namespace that stored it, the layout class, a checksum of the header itself) and the block's
data padded to 4 KiB, so one block is one aligned O_DIRECT I/O and consecutive cells are written or
read with one pwritev / preadv. A header describes its block completely: recovery can list a block
whose journal record was lost, and rebuild a class's meta.json, from the headers alone.

Crash safety (the order is the whole design):
    data first     a block's record is written (and fdatasync'ed) before its ADD goes to the journal;
    pointer second an ADD is appended only after that, so the journal never lists unwritten data;
    delete last    a dropped block gets a REMOVE at once, and a cell is rewritten only after the
                   journal holding its REMOVE was synced.
Recovery (survey) replays the journal, skipping any record that fails its checksum, keeps the
listed blocks whose records lie wholly inside their slab file (a slab cut short keeps what is
before the cut) and whose header says exactly what the journal said. When a journal record was
unreadable it may have been an ADD, so every unlisted cell's header is read too and each intact
one is listed again (the newest generation of a hash wins). Data is never repaired: a doubtful
block is dropped (KV can be recomputed), and every read checks the data against the header's
checksums before the block is served, so a block listed again that was once removed is harmless.

Thread safety: reads, writes and journal I/O run on the disk copy engine's threads (journal I/O
under one lock); forget() runs on the event loop and only queues the REMOVE under a short lock
that no I/O is done under, so the loop never waits for a disk. Queued removals reach the journal
(synced) before any cell is rewritten: every write job flushes them first.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import mmap
import os
import re
import struct
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kvdepotd.core.disk import DISK_ALIGN, DISK_HEADER_BYTES, DISK_MAX_RANKS, disk_record_bytes
from kvdepotd.storage.checksum import xxh3_at, xxh3_bytes

log = logging.getLogger("kvdepotd")

FORMAT_VERSION = 2
MAGIC = b"KVDPBLK2"
# magic, generation, hash, parent, has_parent, ranks, data bytes, owner bytes, class bytes, blocks per
# slab; then ranks x u64 checksums, the owner (namespace) and the layout class in UTF-8, then u64
# header checksum
_HEAD = struct.Struct("<8sQQQB3xIQHHI")
MAX_OWNER_BYTES = 1024  # 256 characters of UTF-8 (core.slots.MAX_ID_LEN)
MAX_CLASS_BYTES = 256
MAX_RANKS = (DISK_HEADER_BYTES - _HEAD.size - 8 - MAX_OWNER_BYTES - MAX_CLASS_BYTES) // 8
assert MAX_RANKS >= DISK_MAX_RANKS, "the core plans disk blocks for engines whose checksums do not fit a header"
# kind, cell, generation, hash, parent, has_parent; then u64 checksum of those bytes
_REC = struct.Struct("<BQQQQB")
REC_BYTES = _REC.size + 8
ADD, REMOVE = 1, 2
MAX_RUN_BYTES = 64 << 20  # most bytes one pwritev / preadv moves
MAX_RUN_RECORDS = 256  # iovecs: two per record, IOV_MAX is 1024
RECOVERY_THREADS = 8  # header reads in flight at start-up
COALESCE_RECORD_BYTES = 64 << 10  # records up to this size are read in runs at start-up (data and all)
JOURNAL = "journal"
META = "meta.json"


class DiskError(RuntimeError):
    """The disk tier cannot be set up as configured; the message says why."""


@dataclass(slots=True)
class Live:
    hash: int
    parent: int | None
    gen: int


@dataclass(frozen=True, slots=True)
class Header:
    """What a block's header says (parse_header)."""

    gen: int
    hash: int
    parent: int | None
    sums: list[int]  # xxh3 of each rank's part of the data
    block_bytes: int
    owner: str  # the namespace whose engine stored it
    layout_class: str
    blocks_per_slab: int  # the geometry of the files it was written into


@dataclass(slots=True)
class Recovered:
    """What start-up found for one layout class."""

    layout_class: str
    block_bytes: int
    blocks: list[tuple[int, int | None, int, str]]  # (hash, parent, cell, owner)
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> blocks
    relisted: int = 0  # blocks the journal had lost, listed again from their headers
    bad_records: int = 0  # journal records that failed their checksum (skipped)


@dataclass(slots=True)
class Survey:
    """A class directory read without changing it (ClassStore.survey): what recovery keeps."""

    live: dict[int, Live]  # cell -> block, each with an intact header that says so
    heads: dict[int, Header]  # cell -> that header (the namespace that stored it, its data's checksums)
    dropped: dict[str, int]  # reason -> blocks given up
    bad_records: int  # journal records that failed their checksum (skipped)
    relisted: int  # unlisted cells whose intact header listed them again


def parse_header(raw: bytes) -> Header | None:
    """A block header, or None when it is not an intact one (any class)."""
    try:
        magic, gen, h, parent, has_parent, ranks, nbytes, olen, clen, per_slab = _HEAD.unpack_from(raw)
        if magic != MAGIC or ranks > MAX_RANKS or olen > MAX_OWNER_BYTES or clen > MAX_CLASS_BYTES:
            return None
        end = _HEAD.size + 8 * ranks + olen + clen
        (want,) = struct.unpack_from("<Q", raw, end)
        if xxh3_bytes(bytes(raw[:end])) != want:
            return None
        sums = list(struct.unpack_from(f"<{ranks}Q", raw, _HEAD.size))
        names = bytes(raw[_HEAD.size + 8 * ranks : end])
        owner, layout_class = names[:olen].decode(), names[olen:].decode()
    except (struct.error, UnicodeDecodeError):
        return None
    return Header(gen, h, parent if has_parent else None, sums, nbytes, owner, layout_class, per_slab)


def class_dir_name(layout_class: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", layout_class)


def _aligned(nbytes: int) -> mmap.mmap:
    return mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))  # anonymous mappings are page aligned


def _view(addr: int, nbytes: int) -> ctypes.Array[ctypes.c_char]:
    return (ctypes.c_char * nbytes).from_address(addr)


class ClassStore:
    """The files of one layout class."""

    def __init__(
        self, root: str, layout_class: str, block_bytes: int, world_size: int, blocks_per_slab: int, direct: bool, read_only: bool = False
    ) -> None:
        """`read_only`: only survey() and reads (check-disk): files are opened for reading and never extended."""
        if world_size > MAX_RANKS:
            raise DiskError(f"layout class {layout_class}: {world_size} ranks do not fit a block header (at most {MAX_RANKS})")
        self.layout_class = layout_class
        self.block_bytes = block_bytes
        self.world_size = world_size
        self.rank_bytes = block_bytes // world_size
        self.record_bytes = disk_record_bytes(block_bytes)
        self.blocks_per_slab = blocks_per_slab
        self.direct = direct
        self.read_only = read_only
        self.dir = os.path.join(root, class_dir_name(layout_class))
        self._class_name = layout_class.encode()
        if len(self._class_name) > MAX_CLASS_BYTES:
            raise DiskError(f"layout class {layout_class[:64]!r}... is longer than a block header holds ({MAX_CLASS_BYTES} bytes)")
        self.live: dict[int, Live] = {}  # cell -> what the journal lists there
        self.gen = 1
        self._lock = threading.Lock()  # live, gen, pending removals: held for no I/O
        self._io_lock = threading.Lock()  # the journal file: appends, syncs, compaction
        self._pending: list[bytes] = []  # REMOVE records not yet in the journal
        self._slabs: dict[int, int] = {}  # slab number -> fd
        self._slab_lock = threading.Lock()
        self._journal_fd = -1
        self._records = 0  # records in the journal file
        self._tls = threading.local()
        self.compact_after = 65_536  # dead records tolerated before the journal is rewritten

    # -- files ---------------------------------------------------------------------------------
    def meta(self) -> dict[str, object]:
        return {
            "version": FORMAT_VERSION,
            "layout_class": self.layout_class,
            "block_bytes": self.block_bytes,
            "world_size": self.world_size,
            "record_bytes": self.record_bytes,
            "blocks_per_slab": self.blocks_per_slab,
        }

    def slab_path(self, slab: int) -> str:
        return os.path.join(self.dir, f"slab-{slab:05d}.kv")

    def _slab_fd(self, slab: int) -> int:
        fd = self._slabs.get(slab)
        if fd is not None:
            return fd
        with self._slab_lock:
            fd = self._slabs.get(slab)
            if fd is None:
                fd = self._slabs[slab] = self._open_slab(slab)
        return fd

    def _open_slab(self, slab: int) -> int:
        path = self.slab_path(slab)
        if self.read_only:
            return os.open(path, os.O_RDONLY)
        size = self.blocks_per_slab * self.record_bytes
        flags = os.O_RDWR | os.O_CREAT
        if self.direct:
            try:
                fd = os.open(path, flags | os.O_DIRECT, 0o600)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                log.warning("disk tier: %s does not support O_DIRECT; using buffered I/O", self.dir)
                self.direct = False
                fd = os.open(path, flags, 0o600)
        else:
            fd = os.open(path, flags, 0o600)
        if os.fstat(fd).st_size < size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:  # a filesystem that refuses fallocate gets a sparse file
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                    os.close(fd)
                    raise
                os.ftruncate(fd, size)
        return fd

    def _bufs(self) -> tuple[mmap.mmap, mmap.mmap | None]:
        """This thread's header buffers and bounce buffer (for blocks whose memory or size is not aligned)."""
        tls = self._tls
        if not hasattr(tls, "heads"):
            run = self.run_records()
            tls.heads = _aligned(run * DISK_HEADER_BYTES)
            tls.bounce = None if self._zero_copy_ok() else _aligned(run * self.record_bytes)
        return tls.heads, tls.bounce

    def run_records(self) -> int:
        return max(1, min(MAX_RUN_RECORDS, MAX_RUN_BYTES // self.record_bytes))

    def _zero_copy_ok(self) -> bool:
        return self.block_bytes % DISK_ALIGN == 0

    # -- headers and journal records ---------------------------------------------------------------
    def _header(self, buf: mmap.mmap, at: int, gen: int, h: int, parent: int | None, sums: list[int], owner: str) -> None:
        o = owner.encode()[:MAX_OWNER_BYTES]
        head = _HEAD.pack(
            MAGIC, gen, h, parent or 0, parent is not None, len(sums), self.block_bytes, len(o), len(self._class_name), self.blocks_per_slab
        )
        body = head + struct.pack(f"<{len(sums)}Q", *sums) + o + self._class_name
        buf[at : at + len(body) + 8] = body + struct.pack("<Q", xxh3_bytes(body))

    def parse_header(self, raw: bytes) -> Header | None:
        """The header, or None when it is not an intact header of this class."""
        head = parse_header(raw)
        if head is None or (len(head.sums), head.block_bytes, head.layout_class, head.blocks_per_slab) != (
            self.world_size, self.block_bytes, self.layout_class, self.blocks_per_slab
        ):
            return None
        return head

    @staticmethod
    def _says(head: Header | None, e: Live | None, h: int) -> bool:
        """The header says what the journal lists for block `h`: its generation, hash and parent."""
        return head is not None and e is not None and e.hash == h and (head.gen, head.hash, head.parent) == (e.gen, e.hash, e.parent)

    def _data_ok(self, addr: int, sums: list[int]) -> bool:
        """The block's data at `addr` matches the header's per-rank checksums."""
        rb = self.rank_bytes
        return all(xxh3_at(addr + r * rb, rb) == s for r, s in enumerate(sums))

    @staticmethod
    def _record(kind: int, cell: int, gen: int, h: int, parent: int | None) -> bytes:
        body = _REC.pack(kind, cell, gen, h, parent or 0, parent is not None)
        return body + struct.pack("<Q", xxh3_bytes(body))

    def _append(self, data: bytes) -> None:
        """One write of whole records (the caller holds the I/O lock)."""
        os.write(self._journal_fd, data)
        self._records += len(data) // REC_BYTES

    # -- set-up and recovery -------------------------------------------------------------------------
    def open_new(self) -> None:
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        write_atomic(os.path.join(self.dir, META), json.dumps(self.meta()).encode())
        self._journal_fd = os.open(os.path.join(self.dir, JOURNAL), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def recover(self, max_slabs: int) -> Recovered:
        """Keeps what the files hold that can be trusted (survey), drops slab files past
        `max_slabs`, rewrites the journal compactly."""
        got = self.survey(max_slabs)
        for slab in [s for s in self._slab_files() if s >= max_slabs]:
            os.unlink(self.slab_path(slab))
        self.live = got.live
        self.gen = max((e.gen for e in got.live.values()), default=0) + 1
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        self._rewrite_journal()
        blocks = [(e.hash, e.parent, cell, got.heads[cell].owner) for cell, e in got.live.items()]
        return Recovered(self.layout_class, self.block_bytes, blocks, got.dropped, got.relisted, got.bad_records)

    def survey(self, max_slabs: int) -> Survey:
        """What recovery would keep, reading the files and changing nothing (check-disk uses it too)."""
        dropped: dict[str, int] = {}

        def drop(reason: str) -> None:
            dropped[reason] = dropped.get(reason, 0) + 1

        entries, bad_records = self._replay()
        slabs = self._slab_files()
        R = self.record_bytes
        for cell in list(entries):
            slab, index = divmod(cell, self.blocks_per_slab)
            if slab >= max_slabs:
                reason = "over the configured size"
            elif slab not in slabs:
                reason = "slab file missing"
            elif (index + 1) * R > slabs[slab]:
                reason = "slab file cut short before it"
            else:
                continue
            del entries[cell]
            drop(reason)
        unlisted: set[int] = set()
        if bad_records:  # a lost ADD: look for intact blocks in every cell the journal does not list
            for slab, size in slabs.items():
                if slab < max_slabs:
                    first = slab * self.blocks_per_slab
                    unlisted.update(c for c in range(first, first + min(self.blocks_per_slab, size // R)) if c not in entries)
        heads = self._headers(sorted([*entries, *unlisted]))
        for cell in list(entries):
            head = heads.get(cell)
            if not self._says(head, entries[cell], entries[cell].hash):
                del entries[cell]
                if bad_records and head is not None:  # an intact newer block whose ADD (or the old one's REMOVE) was lost
                    unlisted.add(cell)
                else:
                    drop("header does not match the journal")
        relisted = 0
        for cell in sorted(unlisted):
            if (head := heads.get(cell)) is not None:
                entries[cell] = Live(head.hash, head.parent, head.gen)
                relisted += 1
        by_hash: dict[int, int] = {}
        for cell, e in sorted(entries.items(), key=lambda kv: kv[1].gen):
            if (old := by_hash.get(e.hash)) is not None:  # listed twice: keep the newer
                del entries[old]
                drop("listed twice")
                relisted -= old in unlisted
            by_hash[e.hash] = cell
        kept = {cell: h for cell in entries if (h := heads.get(cell)) is not None}  # every kept cell has one
        return Survey(entries, kept, dropped, bad_records, relisted)

    def _headers(self, cells: list[int]) -> dict[int, Header | None]:
        """The parsed header of each cell (sorted), None where unreadable or not intact. Small records
        are read in runs of consecutive cells, one preadv each (the headers kept, the data dropped):
        a disk streams them far faster than it answers one small read per block. Larger ones are
        read header by header. RECOVERY_THREADS reads are in flight at a time."""
        longest = self.run_records() if self.record_bytes <= COALESCE_RECORD_BYTES else 1
        runs: list[list[int]] = []
        for cell in cells:
            if runs and cell == runs[-1][-1] + 1 and cell % self.blocks_per_slab and len(runs[-1]) < longest:
                runs[-1].append(cell)
            else:
                runs.append([cell])

        def read(part: list[list[int]]) -> list[tuple[int, Header | None]]:
            return [pair for run in part for pair in zip(run, self._read_headers(run[0], len(run)))]

        step = max(1, -(-len(runs) // RECOVERY_THREADS))
        parts = [runs[k : k + step] for k in range(0, len(runs), step)]
        if len(parts) <= 1:
            return dict(read(runs))
        with ThreadPoolExecutor(len(parts), thread_name_prefix="kvdepot-recover") as pool:
            return {cell: head for got in pool.map(read, parts) for cell, head in got}

    def _replay(self) -> tuple[dict[int, Live], int]:
        """What the journal lists (cell -> block) and how many of its records failed their checksum
        (skipped: one bad record costs at most the block it described; a torn tail is no record)."""
        entries: dict[int, Live] = {}
        try:
            with open(os.path.join(self.dir, JOURNAL), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return entries, 0
        bad = 0
        for k in range(len(data) // REC_BYTES):
            rec = data[k * REC_BYTES : (k + 1) * REC_BYTES]
            body = rec[: _REC.size]
            if struct.unpack_from("<Q", rec, _REC.size)[0] != xxh3_bytes(body):
                bad += 1
                continue
            kind, cell, gen, h, parent, has_parent = _REC.unpack(body)
            if kind == ADD:
                entries[cell] = Live(h, parent if has_parent else None, gen)
            elif kind == REMOVE and (e := entries.get(cell)) is not None and e.hash == h:
                del entries[cell]
        return entries, bad

    def _slab_files(self) -> dict[int, int]:
        out: dict[int, int] = {}
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return out
        for name in names:
            m = re.fullmatch(r"slab-(\d{5})\.kv", name)
            if m:
                out[int(m.group(1))] = os.stat(os.path.join(self.dir, name)).st_size
        return out

    def _read_headers(self, first: int, count: int) -> list[Header | None]:
        """The parsed headers of cells first .. first + count - 1 (one slab), None where unreadable."""
        heads, _ = self._bufs()
        slab, index = divmod(first, self.blocks_per_slab)
        hv = memoryview(heads)
        iov = [hv[k * DISK_HEADER_BYTES : (k + 1) * DISK_HEADER_BYTES] for k in range(count)]
        if count > 1:  # the data of all but the last goes to one scratch buffer, read and dropped
            tls = self._tls
            if getattr(tls, "sink", None) is None:
                tls.sink = _aligned(self.record_bytes - DISK_HEADER_BYTES)
            sink = memoryview(tls.sink)[: self.record_bytes - DISK_HEADER_BYTES]
            iov = [v for k in range(count) for v in ((iov[k], sink) if k < count - 1 else (iov[k],))]
        try:
            n = os.preadv(self._slab_fd(slab), iov, index * self.record_bytes)
        except OSError:
            return [None] * count
        return [  # a short read (a file cut short) leaves the headers past its end unread
            self.parse_header(heads[k * DISK_HEADER_BYTES : (k + 1) * DISK_HEADER_BYTES]) if n >= k * self.record_bytes + DISK_HEADER_BYTES else None
            for k in range(count)
        ]

    def _rewrite_journal(self, live: dict[int, Live] | None = None) -> None:
        """A journal that lists exactly the live blocks, swapped in atomically."""
        live = self.live if live is None else live
        data = b"".join(self._record(ADD, cell, e.gen, e.hash, e.parent) for cell, e in live.items())
        write_atomic(os.path.join(self.dir, JOURNAL), data)
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
        self._journal_fd = os.open(os.path.join(self.dir, JOURNAL), os.O_WRONLY | os.O_APPEND)
        self._records = len(live)

    # -- the data path (copy threads) ----------------------------------------------------------------
    def write(self, blocks: Sequence[tuple[int, int, int | None, int, list[int], str]]) -> set[int]:
        """(cell, hash, parent, source address, rank checksums, owner) per block: writes the records, then
        lists them in the journal. Returns the hashes that could not be written."""
        self.flush_removes()  # delete last: removals are durable before any cell is rewritten
        failed: set[int] = set()
        written: list[tuple[int, int, int | None, int]] = []
        touched: set[int] = set()
        for run in self._runs(sorted(blocks, key=lambda b: b[0])):
            slab, index = divmod(run[0][0], self.blocks_per_slab)
            gens = self._take_gens(len(run))
            try:
                fd = self._slab_fd(slab)
                self._pwrite_run(fd, index, run, gens)
            except OSError as e:
                log.warning("disk tier: writing %d blocks to %s failed: %s", len(run), self.slab_path(slab), e)
                failed.update(b[1] for b in run)
                continue
            touched.add(fd)
            written += [(b[0], b[1], b[2], g) for b, g in zip(run, gens)]
        for fd in touched:
            os.fdatasync(fd)  # data first
        if written:
            with self._io_lock:  # pointer second
                self._append(b"".join(self._record(ADD, s, g, h, p) for s, h, p, g in written))
            with self._lock:
                for s, h, p, g in written:
                    self.live[s] = Live(h, p, g)
        return failed

    def read(self, blocks: Sequence[tuple[int, int, int]]) -> tuple[set[int], set[int], dict[int, list[int]]]:
        """(cell, hash, destination address) per block. Returns (failed, corrupt, checksums by hash):
        failed blocks could not be read; corrupt ones were read but their header or data did not
        check out (they are removed from the journal at once). read_raw() then check()."""
        failed, got = self.read_raw(blocks)
        corrupt, sums = self.check(got)
        return failed, corrupt, sums

    def read_raw(self, blocks: Sequence[tuple[int, int, int]]) -> tuple[set[int], list[tuple[int, int, int, bytes]]]:
        """The I/O half of read(): (failed hashes, [(cell, hash, address, raw header)] of the rest)."""
        failed: set[int] = set()
        got: list[tuple[int, int, int, bytes]] = []
        for run in self._runs(sorted(blocks, key=lambda b: b[0])):
            slab, index = divmod(run[0][0], self.blocks_per_slab)
            try:
                heads = self._pread_run(self._slab_fd(slab), index, run)
            except OSError as e:
                log.warning("disk tier: reading %d blocks from %s failed: %s", len(run), self.slab_path(slab), e)
                failed.update(b[1] for b in run)
                continue
            got += [(cell, h, addr, raw) for (cell, h, addr), raw in zip(run, heads)]
        return failed, got

    def check(self, got: list[tuple[int, int, int, bytes]], data: bool = True) -> tuple[set[int], dict[int, list[int]]]:
        """The checking half of read(): each header must say what the journal says and (with `data`)
        the data must match the header's checksums; without, the caller checks the data against
        them itself. Returns (corrupt hashes, checksums by hash)."""
        corrupt: set[int] = set()
        sums: dict[int, list[int]] = {}
        for cell, h, addr, raw in got:
            with self._lock:
                want = self.live.get(cell)
            head = self.parse_header(raw)
            if head is not None and self._says(head, want, h) and (not data or self._data_ok(addr, head.sums)):
                sums[h] = head.sums
            else:
                corrupt.add(h)
                self.forget(cell, h)
        return corrupt, sums

    def _runs(self, blocks: list[Any]) -> Iterator[list[Any]]:
        """Consecutive cells of one slab, at most run_records() long."""
        run: list[Any] = []
        limit = self.run_records()
        for b in blocks:
            if run and (b[0] != run[-1][0] + 1 or b[0] % self.blocks_per_slab == 0 or len(run) == limit):
                yield run
                run = []
            run.append(b)
        if run:
            yield run

    def _take_gens(self, n: int) -> list[int]:
        with self._lock:
            first = self.gen
            self.gen += n
        return list(range(first, first + n))

    def _pwrite_run(self, fd: int, index: int, run: list[Any], gens: list[int]) -> None:
        heads, bounce = self._bufs()
        H, R, B = DISK_HEADER_BYTES, self.record_bytes, self.block_bytes
        iov: list[object] = []
        for k, ((_, h, parent, addr, sums, owner), gen) in enumerate(zip(run, gens)):
            if bounce is None:
                self._header(heads, k * H, gen, h, parent, sums, owner)
                iov += [memoryview(heads)[k * H : (k + 1) * H], _view(addr, B)]
            else:
                self._header(bounce, k * R, gen, h, parent, sums, owner)
                ctypes.memmove(ctypes.addressof(ctypes.c_char.from_buffer(bounce, k * R + H)), addr, B)
        if bounce is not None:
            iov = [memoryview(bounce)[: len(run) * R]]
        want = len(run) * (R if bounce is not None else H + B)
        n = os.pwritev(fd, iov, index * R)  # type: ignore[arg-type]
        if n != want:
            raise OSError(errno.EIO, f"short write ({n} of {want} bytes)")

    def _pread_run(self, fd: int, index: int, run: list[Any]) -> list[bytes]:
        heads, bounce = self._bufs()
        H, R, B = DISK_HEADER_BYTES, self.record_bytes, self.block_bytes
        if bounce is None:
            iov: list[object] = []
            for k, (_, _, addr) in enumerate(run):
                iov += [memoryview(heads)[k * H : (k + 1) * H], _view(addr, B)]
            want = len(run) * (H + B)
        else:
            iov = [memoryview(bounce)[: len(run) * R]]
            want = len(run) * R
        n = os.preadv(fd, iov, index * R)  # type: ignore[arg-type]
        if n != want:
            raise OSError(errno.EIO, f"short read ({n} of {want} bytes)")
        if bounce is None:
            return [heads[k * H : k * H + H] for k in range(len(run))]
        out = []
        for k, (_, _, addr) in enumerate(run):
            out.append(bounce[k * R : k * R + H])
            ctypes.memmove(addr, ctypes.addressof(ctypes.c_char.from_buffer(bounce, k * R + H)), B)
        return out

    # -- removal, compaction, shutdown ---------------------------------------------------------------
    def forget(self, cell: int, h: int) -> bool:
        """The block at `cell` is no longer listed; its REMOVE is queued (True) for flush_removes."""
        with self._lock:
            e = self.live.get(cell)
            if e is None or e.hash != h:
                return False
            del self.live[cell]
            self._pending.append(self._record(REMOVE, cell, e.gen, h, e.parent))
            return True

    def flush_removes(self, sync: bool = True) -> None:
        """Queued REMOVEs into the journal (and synced, so the cells may be rewritten)."""
        with self._io_lock:
            with self._lock:
                data = b"".join(self._pending)
                self._pending.clear()
            if data:
                self._append(data)
                if sync:
                    os.fdatasync(self._journal_fd)

    def maybe_compact(self) -> bool:
        """Rewrites the journal when most of its records are dead (a copy thread calls this)."""
        with self._io_lock:
            with self._lock:
                if self._records < 4 * len(self.live) + self.compact_after:
                    return False
                live = dict(self.live)  # queued removals are not in it: they need no record any more
                self._pending.clear()
            self._rewrite_journal(live)
        return True

    def close(self) -> None:
        self.flush_removes(sync=False)
        with self._io_lock:
            if self._journal_fd >= 0:
                os.fsync(self._journal_fd)
                os.close(self._journal_fd)
                self._journal_fd = -1
        with self._slab_lock:
            for fd in self._slabs.values():
                os.close(fd)
            self._slabs.clear()


def write_atomic(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(os.path.dirname(path), os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
