"""The disk tier's files without a daemon: records, journal order, recovery, compaction."""

from __future__ import annotations

import ctypes
import mmap
import os

import pytest

from kvdepotd.storage.checksum import xxh3_at
from kvdepotd.storage.disk import JOURNAL, REC_BYTES, ClassStore, DiskError
from kvdepotd.storage.disk_dir import DiskStore, verify

pytestmark = pytest.mark.integration


def blocks(n: int, nbytes: int, seed: int = 1) -> tuple[mmap.mmap, int]:
    buf = mmap.mmap(-1, n * nbytes)
    buf.write(bytes((seed * 31 + i * 7) % 251 for i in range(n * nbytes)))
    return buf, ctypes.addressof(ctypes.c_char.from_buffer(buf))


def store(root: str, block_bytes: int, world_size: int = 1, per_slab: int = 8) -> ClassStore:
    s = ClassStore(root, "L2xH1xD4xfloat16xB16xW1", block_bytes, world_size, per_slab, True)
    s.open_new()
    return s


def write(s: ClassStore, base: int, slots: list[int], first_hash: int = 100) -> set[int]:
    rb = s.rank_bytes
    items = []
    for k, slot in enumerate(slots):
        addr = base + k * s.block_bytes
        sums = [int(xxh3_at(addr + r * rb, rb)) for r in range(s.world_size)]
        items.append((slot, first_hash + k, (first_hash + k - 1) if k else None, addr, sums, "team-a"))
    return s.write(items)


@pytest.mark.parametrize("block_bytes,world_size", [(8192, 1), (3072, 1), (8192, 2)], ids=["aligned", "bounce", "tp2"])
def test_round_trip_and_corruption(tmp_path: str, block_bytes: int, world_size: int) -> None:
    s = store(str(tmp_path), block_bytes, world_size)
    src, base = blocks(12, block_bytes)
    assert write(s, base, list(range(12))) == set()  # crosses a slab boundary (8 per slab)
    dst, dbase = blocks(12, block_bytes, seed=9)
    failed, corrupt, sums = s.read([(k, 100 + k, dbase + k * block_bytes) for k in range(12)])
    assert (failed, corrupt) == (set(), set()) and len(sums) == 12
    assert dst[:] == src[:]
    with open(s.slab_path(0), "r+b") as f:  # one flipped data byte in slot 5
        f.seek(5 * s.record_bytes + 4096 + block_bytes - 1)
        f.write(b"\x00" if src[6 * block_bytes - 1] else b"\x01")
    failed, corrupt, _ = s.read([(5, 105, dbase)])
    assert corrupt == {105} and 5 not in s.live
    s.flush_removes()
    s.close()
    assert verify(str(tmp_path)) == {"classes": 1, "blocks": 11, "valid": 11, "bad": 0, "relisted": 0, "problems": []}


def test_reading_a_slot_under_another_hash_is_corrupt(tmp_path: str) -> None:
    s = store(str(tmp_path), 4096)
    _, base = blocks(2, 4096)
    write(s, base, [0, 1])
    _, corrupt, _ = s.read([(1, 100, base)])  # slot 1 holds hash 101
    assert corrupt == {100}


def test_recovery_keeps_what_the_journal_lists_and_the_headers_confirm(tmp_path: str) -> None:
    root = str(tmp_path)
    s = store(root, 4096)
    _, base = blocks(6, 4096)
    write(s, base, [0, 1, 2, 3, 4, 5])
    s.forget(4, 104)  # removed: not recovered even though its record is intact
    s.flush_removes()
    s.close()
    with open(os.path.join(root, s.dir, JOURNAL), "ab") as f:
        f.write(b"\x01\x02")  # a torn record (not a record: nothing lost)
    with open(s.slab_path(0), "r+b") as f:  # slot 2's header damaged
        f.seek(2 * s.record_bytes + 9)
        f.write(b"\x07")
    r = store(root, 4096)
    got = r.recover(max_slabs=10)
    assert sorted(h for h, _, _, _ in got.blocks) == [100, 101, 103, 105]
    assert got.dropped == {"header does not match the journal": 1} and got.bad_records == got.relisted == 0
    assert [(h, p, o) for h, p, _, o in sorted(got.blocks)][:2] == [(100, None, "team-a"), (101, 100, "team-a")]
    with open(os.path.join(root, s.dir, JOURNAL), "rb") as f:  # rewritten: exactly the survivors
        assert len(f.read()) == 4 * REC_BYTES


def test_recovery_drops_blocks_beyond_the_size_or_in_missing_files(tmp_path: str) -> None:
    root = str(tmp_path)
    s = store(root, 4096, per_slab=2)
    _, base = blocks(6, 4096)
    write(s, base, [0, 1, 2, 3, 4, 5])  # three slab files
    s.close()
    os.unlink(s.slab_path(1))
    got = store(root, 4096, per_slab=2).recover(max_slabs=2)
    assert sorted(slot for _, _, slot, _ in got.blocks) == [0, 1]
    assert got.dropped == {"slab file missing": 2, "over the configured size": 2}
    assert not os.path.exists(s.slab_path(2))


def test_compaction_keeps_the_live_set(tmp_path: str) -> None:
    root = str(tmp_path)
    s = store(root, 4096)
    s.compact_after = 4
    _, base = blocks(8, 4096)
    for round_no in range(5):
        write(s, base, list(range(8)), first_hash=1000 * (round_no + 1))
        if round_no < 4:
            for k in range(8):
                s.forget(k, 1000 * (round_no + 1) + k)
    assert s.maybe_compact()
    s.close()
    got = store(root, 4096).recover(max_slabs=10)
    assert sorted(h for h, _, _, _ in got.blocks) == list(range(5000, 5008)) and not got.dropped


def test_one_directory_one_store(tmp_path: str) -> None:
    a = DiskStore(str(tmp_path), 1 << 20)
    with pytest.raises(DiskError, match="another kvdepotd uses"):
        DiskStore(str(tmp_path), 1 << 20)
    a.close()
    DiskStore(str(tmp_path), 1 << 20).close()


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory) -> str:  # type: ignore[override]
    return str(tmp_path_factory.mktemp("store"))


@pytest.mark.parametrize(
    "meta",
    [b"", b"[]", b"\xff\xfe garbage", b'{"version": 2, "layout_class": 5}', b'{"version": 2, "layout_class": "x", "block_bytes": -1, "world_size": 1, '
     b'"record_bytes": 8192, "blocks_per_slab": 8}', b'{"version": 1}'],
)
def test_check_disk_reports_malformed_files_and_never_crashes(tmp_path: str, meta: bytes) -> None:
    d = os.path.join(tmp_path, "some-class")
    os.makedirs(d)
    with open(os.path.join(d, "meta.json"), "wb") as f:
        f.write(meta)
    with open(os.path.join(d, JOURNAL), "wb") as f:
        f.write(os.urandom(REC_BYTES * 3 + 5))
    with open(os.path.join(d, "slab-00000.kv"), "wb") as f:
        f.write(os.urandom(3 * 8192))
    report = verify(tmp_path)
    assert report["problems"] and report["valid"] == 0, report
    assert "meta.json" in report["problems"][0]


def test_a_damaged_meta_json_is_rebuilt_from_the_headers_and_a_cut_slab_keeps_what_precedes_the_cut(tmp_path: str) -> None:
    s = store(tmp_path, 4096)
    _, base = blocks(8, 4096)
    write(s, base, list(range(8)))
    s.close()
    os.unlink(os.path.join(s.dir, "meta.json"))
    os.truncate(s.slab_path(0), 5 * s.record_bytes + 100)  # cells 0-4 whole, 5 cut, 6-7 gone
    report = verify(tmp_path)
    assert report["blocks"] == report["valid"] == 5 and report["bad"] == 3, report
    assert any("3 blocks dropped: slab file cut short before it" in p for p in report["problems"])
    assert any("meta.json is missing; rebuilt from the block headers" in p for p in report["problems"])
    assert os.path.getsize(s.slab_path(0)) == 5 * s.record_bytes + 100  # check-disk changed nothing
    assert not os.path.exists(os.path.join(s.dir, "meta.json"))


def test_with_a_journal_record_lost_an_intact_header_wins_over_a_stale_listing(tmp_path: str) -> None:
    """A damaged journal may have lost the REMOVE of a cell's old block and the ADD of the block
    written there after it: the cell's intact header is the truth, and its block is kept."""
    s = store(tmp_path, 4096)
    _, base = blocks(4, 4096)
    write(s, base, [0, 1, 2, 3])
    s.forget(2, 102)
    s.flush_removes()
    write(s, base, [2], first_hash=900)  # cell 2 now holds block 900
    s.close()
    with open(os.path.join(s.dir, JOURNAL), "r+b") as f:  # damage the REMOVE and the new ADD
        f.seek(4 * REC_BYTES + 3)
        f.write(b"\xff\xff")
        f.seek(5 * REC_BYTES + 3)
        f.write(b"\xff\xff")
    got = store(tmp_path, 4096).recover(max_slabs=10)
    assert got.bad_records == 2 and not got.dropped
    assert sorted(h for h, _, _, _ in got.blocks) == [100, 101, 103, 900]
