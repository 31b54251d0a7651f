"""KV files of dead engine processes are removed; live ones and other files are kept."""

from __future__ import annotations

import os
import subprocess
import sys

from kvdepot.handles import remove_stale_files


def test_stale_kv_files_of_dead_processes_are_removed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    files = {
        "dead": tmp_path / f"kvdepot-{dead}-abc.kv",
        "alive": tmp_path / f"kvdepot-{os.getpid()}-abc.kv",
        "other": tmp_path / "something-else.kv",
        "odd": tmp_path / "kvdepot-notapid-abc.kv",
    }
    for f in files.values():
        f.write_bytes(b"x")
    removed = remove_stale_files(str(tmp_path))
    assert removed == [str(files["dead"])]
    assert not files["dead"].exists()
    assert all(files[k].exists() for k in ("alive", "other", "odd"))
