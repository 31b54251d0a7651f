"""The disk tier's directory: a lock (one daemon per directory), one subdirectory of files per
layout class (kvdepotd.storage.disk.ClassStore), and what `kvdepotd check-disk` reads.

    DiskStore(root, total_bytes, direct)   checks the directory is usable, free and ours; locks it
        existing() -> [meta]               the class directories present
        new_class(...) / recover(...)      a class's store, empty or recovered at start-up
        classes                            layout class -> ClassStore
    read_meta(class dir) -> (meta, problem) meta.json checked, or rebuilt from the block headers
    verify(root) -> report                 every block checked as recovery would, read-only
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import time
from typing import Any

from kvdepotd.core.disk import DISK_ALIGN, DISK_HEADER_BYTES, disk_record_bytes
from kvdepotd.storage.disk import (
    FORMAT_VERSION, JOURNAL, MAGIC, MAX_RANKS, META, ClassStore, DiskError, Header, Recovered, write_atomic, class_dir_name, parse_header,
)

log = logging.getLogger("kvdepotd")


class DiskStore:
    """Every layout class under one directory."""

    def __init__(self, root: str, total_bytes: int, direct: bool = True) -> None:
        self.root = root
        self.total_bytes = total_bytes
        self.direct = direct
        self.classes: dict[str, ClassStore] = {}
        try:
            os.makedirs(root, mode=0o700, exist_ok=True)
            probe = os.path.join(root, ".kvdepotd-probe")
            with open(probe, "wb") as f:
                f.write(b"ok")
            os.unlink(probe)
        except OSError as e:
            raise DiskError(f"the disk tier directory {root} is not usable: {e.strerror}") from None
        self._lock_fd = os.open(os.path.join(root, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:  # held until the process ends, however it ends
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise DiskError(f"another kvdepotd uses {root} (it holds {os.path.join(root, 'lock')})") from None
        ours = sum(os.stat(os.path.join(d, f)).st_size for d, _, fs in os.walk(root) for f in fs)
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize + ours
        if free < total_bytes:
            raise DiskError(
                f"the disk tier needs {total_bytes / 2**30:.2f} GiB but {root} has {free / 2**30:.2f} GiB free "
                "(counting the tier's own files): lower --disk-gib or free space"
            )

    def existing(self) -> list[dict[str, Any]]:
        """The meta.json of every class directory present. A damaged or missing meta.json is rebuilt
        from the block headers (and written back); a directory with neither holds nothing that can
        be read and its files are removed."""
        out = []
        for name in sorted(os.listdir(self.root)):
            d = os.path.join(self.root, name)
            if not os.path.isdir(d):
                continue
            meta, problem = read_meta(d)
            if problem:
                log.warning("disk tier: %s: %s", d, problem)
            if meta is None:
                _clear(d)
                continue
            if problem:
                write_atomic(os.path.join(d, META), json.dumps(meta).encode())
            out.append(meta)
        return out

    def new_class(self, layout_class: str, block_bytes: int, world_size: int, blocks_per_slab: int) -> ClassStore:
        """A class with no files yet (its directory is created); visible to other threads only once open."""
        store = ClassStore(self.root, layout_class, block_bytes, world_size, blocks_per_slab, self.direct)
        store.open_new()
        self.classes[layout_class] = store
        return store

    def recover(self, layout_class: str, block_bytes: int, world_size: int, blocks_per_slab: int, max_slabs: int) -> Recovered:
        """One class found at start-up; a class whose files were made with another geometry is
        started empty (its files are removed)."""
        t0 = time.monotonic()
        store = ClassStore(self.root, layout_class, block_bytes, world_size, blocks_per_slab, self.direct)
        meta, _ = read_meta(store.dir)
        if meta != store.meta():
            n = len(store._replay()[0])
            _clear(store.dir)
            self.new_class(layout_class, block_bytes, world_size, blocks_per_slab)
            return Recovered(layout_class, block_bytes, [], {"files made with another geometry": n} if n else {})
        got = store.recover(max_slabs)
        self.classes[layout_class] = store
        log.debug("disk tier: %s recovered in %.3f s", layout_class, time.monotonic() - t0)
        return got

    def close(self) -> None:
        for store in self.classes.values():
            store.close()
        os.close(self._lock_fd)


def read_meta(d: str) -> tuple[dict[str, Any] | None, str]:
    """A class directory's meta.json, checked, and what was wrong with it (empty when nothing).
    A meta.json that is missing, does not parse or says something impossible is rebuilt from the
    first intact block header in the slab files (a header names its class, block size, ranks and
    blocks per slab); None when there is none."""
    try:
        with open(os.path.join(d, META), "rb") as f:
            raw = json.loads(f.read())
        return _checked_meta(raw), ""
    except FileNotFoundError:
        problem = "meta.json is missing"
    except (OSError, ValueError, TypeError, KeyError) as e:
        problem = f"meta.json is damaged ({type(e).__name__}: {e})"
    rebuilt = _meta_from_headers(d)
    if rebuilt is None:
        return None, problem + "; no intact block header to rebuild it from: the directory holds nothing usable"
    return rebuilt, problem + "; rebuilt from the block headers"


def _checked_meta(raw: object) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    if raw.get("version") != FORMAT_VERSION:
        raise ValueError(f"format version {raw.get('version')!r}, this daemon reads {FORMAT_VERSION}")
    meta = {k: raw[k] for k in ("version", "layout_class", "block_bytes", "world_size", "record_bytes", "blocks_per_slab")}
    ok = (
        isinstance(meta["layout_class"], str)
        and all(type(meta[k]) is int and meta[k] > 0 for k in ("block_bytes", "world_size", "record_bytes", "blocks_per_slab"))
        and meta["world_size"] <= MAX_RANKS
        and meta["block_bytes"] % meta["world_size"] == 0
        and meta["record_bytes"] == disk_record_bytes(meta["block_bytes"])
    )
    if not ok:
        raise ValueError(f"impossible values {meta}")
    return meta


HEADER_SCAN_BYTES = 256 << 20  # how far into a slab file a meta.json rebuild looks for a header


def _meta_from_headers(d: str) -> dict[str, Any] | None:
    slabs = sorted(n for n in os.listdir(d) if n.startswith("slab-") and n.endswith(".kv"))
    for name in slabs:
        try:
            with open(os.path.join(d, name), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                at = 0
                while at < min(size, HEADER_SCAN_BYTES):  # records start on DISK_ALIGN boundaries
                    chunk = f.read(1 << 20)
                    if not chunk:
                        break
                    for k in range(0, len(chunk) - DISK_HEADER_BYTES + 1, DISK_ALIGN):
                        if chunk[k : k + 8] == MAGIC and (head := parse_header(chunk[k : k + DISK_HEADER_BYTES])) is not None:
                            return _meta_of_header(d, head)
                    at += len(chunk)
        except OSError:
            continue
    return None


def _meta_of_header(d: str, head: Header) -> dict[str, Any] | None:
    try:
        meta = _checked_meta(
            {"version": FORMAT_VERSION, "layout_class": head.layout_class, "block_bytes": head.block_bytes,
             "world_size": len(head.sums), "record_bytes": disk_record_bytes(head.block_bytes), "blocks_per_slab": head.blocks_per_slab}
        )
    except ValueError:
        return None
    return meta if class_dir_name(head.layout_class) == os.path.basename(d) else None


def _clear(d: str) -> None:
    """Removes a class directory's own files (nothing else that may be in it)."""
    for name in os.listdir(d):
        if name in (META, JOURNAL, META + ".tmp", JOURNAL + ".tmp") or (name.startswith("slab-") and name.endswith(".kv")):
            os.unlink(os.path.join(d, name))


def verify(root: str) -> dict[str, Any]:
    """Reads every block a class directory holds the way recovery would (ClassStore.survey), then
    checks each one's data, changing nothing: what `kvdepotd check-disk` prints. `problems` names
    every block the tool cannot vouch for and every damaged file; the daemon would drop those
    blocks at start-up or at their first read, and never serve them."""
    out: dict[str, Any] = {"classes": 0, "blocks": 0, "valid": 0, "bad": 0, "relisted": 0, "problems": []}
    problems: list[str] = out["problems"]
    try:
        names = sorted(os.listdir(root))
    except OSError as e:
        problems.append(f"{root}: {e.strerror}")
        return out
    for name in names:
        d = os.path.join(root, name)
        if not os.path.isdir(d):
            continue
        try:
            _verify_class(d, out)
        except Exception as e:  # a file no check foresaw: report it, go on with the other classes
            problems.append(f"{name}: could not be checked ({type(e).__name__}: {e})")
    return out


def _verify_class(d: str, out: dict[str, Any]) -> None:
    name = os.path.basename(d)
    problems: list[str] = out["problems"]
    meta, problem = read_meta(d)
    if problem:
        problems.append(f"{name}: {problem}")
    if meta is None:
        return
    out["classes"] += 1
    store = ClassStore(os.path.dirname(d), meta["layout_class"], meta["block_bytes"], meta["world_size"], meta["blocks_per_slab"], False, read_only=True)
    got = store.survey(max_slabs=1 << 30)
    if got.bad_records:
        problems.append(f"{name}: {got.bad_records} journal records fail their checksum (skipped; their blocks are looked for by header)")
    for reason, n in sorted(got.dropped.items()):
        problems.append(f"{name}: {n} blocks dropped: {reason}")
        out["bad"] += n
    out["relisted"] += got.relisted
    buf = bytearray(store.block_bytes)
    addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    try:
        for cell, e in sorted(got.live.items()):
            out["blocks"] += 1
            slab, index = divmod(cell, store.blocks_per_slab)
            at = index * store.record_bytes + DISK_HEADER_BYTES  # the data: survey() read and checked the header
            try:
                whole = os.preadv(store._slab_fd(slab), [buf], at) == len(buf)
            except OSError:
                whole = False
            if whole and store._data_ok(addr, got.heads[cell].sums):
                out["valid"] += 1
                continue
            out["bad"] += 1
            problems.append(f"{name}: block {e.hash:016x} (cell {cell}): its data does not match its header's checksums")
    finally:
        store.close()
