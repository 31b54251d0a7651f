"""The disk tier under damage: a daemon stores 144 blocks and stops; a file is damaged the way a
failing disk or a careless operator would; `kvdepotd check-disk` must report the damage (exit 1,
never a crash), and the restarted daemon must keep every intact block and serve only right bytes.

Each case prints one line (`fault: disk damage, <case>: tried N, survived N, lost N`): docs/disk.md
has the figures."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import Callable

import pytest

from kvdepot import DepotClient, KvLayout
from kvdepot.testing import DaemonProcess
from kvdepotd.core.disk import DISK_HEADER_BYTES
from kvdepotd.storage.disk import JOURNAL, META, REC_BYTES
from tests.integration.conftest import attached_engine, close_engine

pytestmark = pytest.mark.fault

LAY = KvLayout(num_layers=4, num_kv_heads=2, head_size=8, dtype="float16", block_size=16, kind="vllm_cpu")  # 4 KiB blocks
RECORD = DISK_HEADER_BYTES + LAY.block_bytes
PROMPTS = [list(range(10_000 * (k + 1), 10_000 * (k + 1) + 16 * 16 + 3)) for k in range(9)]  # 9 x 16 = 144 blocks
BLOCKS = 144


def daemon(disk_dir: str) -> DaemonProcess:
    return DaemonProcess(args=["--disk-dir", disk_dir, "--disk-gib", "0.02", "--disk-slab-mib", "1", "--disk-admit-after", "1"]).start()


def class_dir(disk_dir: str) -> str:
    (name,) = [n for n in os.listdir(disk_dir) if os.path.isdir(os.path.join(disk_dir, n))]
    return os.path.join(disk_dir, name)


def check_disk(disk_dir: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "kvdepotd", "check-disk", disk_dir], capture_output=True, text=True, timeout=60)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, json.loads(out.stdout)


def filled(disk_dir: str) -> None:
    d = daemon(disk_dir)
    e = attached_engine(d, LAY, "damage-model")
    for p in PROMPTS:
        e.generate(p, max_new_tokens=1)
    close_engine(e)
    assert d.stop() == 0  # write-back: the clean stop writes every admitted block
    assert check_disk(disk_dir) == (0, {"classes": 1, "blocks": BLOCKS, "valid": BLOCKS, "bad": 0, "relisted": 0, "problems": []})


def flip(path: str, at: int, bit: int = 0) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)[0]
        f.seek(at)
        f.write(bytes([b ^ (1 << bit)]))


def restarted(disk_dir: str) -> tuple[int, int]:
    """Blocks the restarted daemon kept, and of those, how many failed their data check when the
    prompts were generated again (never served: every prompt loads only right bytes)."""
    d = daemon(disk_dir)
    try:
        with DepotClient(d.tcp) as c:
            kept = c.stats().disk_recovered_blocks
        e = attached_engine(d, LAY, "damage-model")
        for p in PROMPTS:
            e.generate(p, max_new_tokens=1)
        assert e.stats.kv_mismatched_tokens == 0, "a damaged block was served"
        assert e.stats.loaded_tokens > 0 or kept == 0
        failed = e.client.stats().counters["disk_checksum_failures"]
        close_engine(e)
    finally:
        assert d.stop() == 0
    assert "Traceback" not in d.log(), d.log()
    return kept, failed


def journal_flip(d: str) -> int:
    flip(os.path.join(d, JOURNAL), (os.path.getsize(os.path.join(d, JOURNAL)) // REC_BYTES // 3) * REC_BYTES + 12, 3)
    return BLOCKS


def slab_cut(d: str) -> int:
    path = os.path.join(d, "slab-00000.kv")
    os.truncate(path, 42 * RECORD + RECORD // 2)  # mid-record: cells 0..41 are whole
    return 42 + BLOCKS - 128  # slab 0 holds cells 0..127 (1 MiB of 8 KiB records), all written


def meta_flip(d: str) -> int:
    flip(os.path.join(d, META), 5, 1)
    return BLOCKS


def meta_misspelled(d: str) -> int:
    path = os.path.join(d, META)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text.replace('"block_bytes"', '"blok_bytes"'))
    return BLOCKS


def meta_gone(d: str) -> int:
    os.unlink(os.path.join(d, META))
    return BLOCKS


def random_flips(d: str) -> int:
    """50 bit flips anywhere in the class's files; a block survives unless its header or its data was hit."""
    rng = random.Random(28)
    files = [os.path.join(d, n) for n in sorted(os.listdir(d))]
    sizes = [os.path.getsize(f) for f in files]
    hit: set[int] = set()
    for _ in range(50):
        at = rng.randrange(sum(sizes))
        for f, size in zip(files, sizes):
            if at < size:
                flip(f, at, rng.randrange(8))
                if f.endswith(".kv"):
                    hit.add(int(os.path.basename(f)[5:10]) * 128 + at // RECORD)
                break
            at -= size
    return BLOCKS - len(hit)  # at least this many (a flip past a header's end harms nothing)


CASES: dict[str, Callable[[str], int]] = {
    "one bit of the journal": journal_flip,
    "slab 0 cut mid-record": slab_cut,
    "one bit of meta.json": meta_flip,
    "a misspelled key in meta.json": meta_misspelled,
    "meta.json deleted": meta_gone,
    "50 random bit flips": random_flips,
}


@pytest.mark.parametrize("case", list(CASES))
def test_damage_is_reported_and_every_intact_block_kept(tmp_path_factory: pytest.TempPathFactory, case: str) -> None:
    disk_dir = str(tmp_path_factory.mktemp("damage"))
    filled(disk_dir)
    want = CASES[case](class_dir(disk_dir))
    rc, report = check_disk(disk_dir)
    assert rc == 1 and report["problems"], report  # the damage is reported
    kept, failed = restarted(disk_dir)
    served = kept - failed  # kept at start and read back valid
    print(
        f"\nfault: disk damage, {case}: tried {BLOCKS}, survived {served}, lost {BLOCKS - served} "
        f"({BLOCKS - kept} dropped at start, {failed} at their first read; at least {want} were intact); check-disk: {report['problems'][:2]}"
    )
    if case == "50 random bit flips":
        assert want <= kept - failed and kept <= BLOCKS
        assert report["valid"] >= want
    else:
        assert kept == want and failed == 0, report
    assert check_disk(disk_dir)[0] == 0  # recovery left a consistent directory behind
