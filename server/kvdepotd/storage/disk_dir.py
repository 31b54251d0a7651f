"""The disk tier's directory: a lock (one daemon per directory), one subdirectory of files per
layout class (kvdepotd.storage.disk.ClassStore), and what `kvdepotd check-disk` reads.

    DiskStore(root, total_bytes, direct)   checks the directory is usable, free and ours; locks it
        existing() -> [meta]               the class directories present
        new_class(...) / recover(...)      a class's store, empty or recovered at start-up
        classes                            layout class -> ClassStore
    verify(root) -> counts                 every listed block's header and data checked, read-only
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import logging
import os
import time

from kvdepotd.core.disk import DISK_HEADER_BYTES
from kvdepotd.storage.disk import FORMAT_VERSION, META, ClassStore, DiskError, Recovered

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

    def existing(self) -> list[dict[str, object]]:
        """meta.json of every class directory present (unreadable ones are skipped with a warning)."""
        out = []
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name, META)
            if not os.path.isfile(path):
                continue
            try:
                with open(path, "rb") as f:
                    meta = json.loads(f.read())
                if not isinstance(meta, dict) or meta.get("version") != FORMAT_VERSION:
                    raise ValueError("unknown format version")
                out.append(meta)
            except (OSError, ValueError) as e:
                log.warning("disk tier: ignoring %s (%s)", os.path.join(self.root, name), e)
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
        meta = self._meta_of(store)
        if meta != store.meta():
            n = len(store._replay({}))
            for name in os.listdir(store.dir):
                os.unlink(os.path.join(store.dir, name))
            self.new_class(layout_class, block_bytes, world_size, blocks_per_slab)
            return Recovered(layout_class, block_bytes, [], {"files made with another geometry": n} if n else {})
        got = store.recover(max_slabs)
        self.classes[layout_class] = store
        log.debug("disk tier: %s recovered in %.3f s", layout_class, time.monotonic() - t0)
        return got

    @staticmethod
    def _meta_of(store: ClassStore) -> dict[str, object] | None:
        try:
            with open(os.path.join(store.dir, META), "rb") as f:
                meta = json.loads(f.read())
            return meta if isinstance(meta, dict) else None
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        for store in self.classes.values():
            store.close()
        os.close(self._lock_fd)


def verify(root: str) -> dict[str, int]:
    """Reads every block the journals list (buffered, read-only) and checks its header and data:
    what `kvdepotd check-disk` prints. A block the journal lists that does not check out counts as
    bad; the daemon would drop it at start-up or at its first read, and never serve it."""
    out = {"classes": 0, "listed": 0, "valid": 0, "bad": 0}
    for name in sorted(os.listdir(root)):
        try:
            with open(os.path.join(root, name, META), "rb") as f:
                meta = json.loads(f.read())
        except (OSError, ValueError):
            continue
        store = ClassStore(root, meta["layout_class"], meta["block_bytes"], meta["world_size"], meta["blocks_per_slab"], False)
        out["classes"] += 1
        buf = bytearray(DISK_HEADER_BYTES + store.block_bytes)
        data_addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) + DISK_HEADER_BYTES
        for cell, e in store._replay({}).items():
            out["listed"] += 1
            slab, index = divmod(cell, store.blocks_per_slab)
            try:
                with open(store.slab_path(slab), "rb") as f:
                    f.seek(index * store.record_bytes)
                    whole = f.readinto(buf) == len(buf)
            except OSError:
                whole = False
            head = store.parse_header(bytes(buf[:DISK_HEADER_BYTES])) if whole else None
            ok = head is not None and store._says(head, e, e.hash) and store._data_ok(data_addr, head[3])
            out["valid" if ok else "bad"] += 1
    return out
