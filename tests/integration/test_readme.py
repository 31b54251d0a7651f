"""The README's quickstart, run as written: its daemon command in the background (as the first
terminal), then each shell block marked `quickstart` with bash and the Python block saved as
quickstart.py and run with .venv/bin/python, in order, from the repository root. The outputs the
README promises must appear, and Ctrl-C must drain the daemon. It uses the default ports (50061,
9464), so it is its own stage: `scripts/test -m readme` (.ci/run runs it)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.readme

ROOT = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"<!-- quickstart(?:: (\w+))? -->\n```(\w+)\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str, str]]:
    """(role, language, code) of each marked block, in README order."""
    return [(role or "run", lang, code) for role, lang, code in BLOCK.findall((ROOT / "README.md").read_text())]


def test_the_marked_blocks_are_there() -> None:
    roles = [role for role, _, _ in blocks()]
    assert roles[0] == "daemon" and roles.count("daemon") == 1 and "python" in roles and "run" in roles


def run(cmd: list[str], env: dict[str, str]) -> str:
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_quickstart_as_written(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVDEPOT_COMPILE")}  # a fresh terminal
    steps = blocks()
    (_, _, daemon_cmd), rest = steps[0], steps[1:]
    log = open(tmp_path / "daemon.log", "w+")
    daemon = subprocess.Popen(["bash", "-c", "exec " + daemon_cmd.strip()], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600  # a first run sets up .venv and compiles the core
        while "serving on 127.0.0.1:50061" not in (tmp_path / "daemon.log").read_text():
            assert daemon.poll() is None, (tmp_path / "daemon.log").read_text()
            assert time.monotonic() < deadline, "the daemon did not serve within 10 minutes"
            time.sleep(0.1)
        out = ""
        for _, lang, code in rest:
            if lang == "python":
                (tmp_path / "quickstart.py").write_text(code)
                out += run([str(ROOT / ".venv/bin/python"), str(tmp_path / "quickstart.py")], env)
            else:
                out += run(["bash", "-euo", "pipefail", "-c", code], env)
        readme = (ROOT / "README.md").read_text()
        promised = re.search(r"It prints `([^`]+)` and `([^`]+)`", readme)
        assert promised is not None, "the README no longer says what quickstart.py prints"
        for line in promised.groups():
            assert line in out, f"the README promises {line!r}; the quickstart printed:\n{out}"
        assert "SERVING" in out and "kvdepot_engines " in out and "kvdepot_stored_blocks_total 4.0" in out, out
    finally:
        daemon.send_signal(signal.SIGINT)  # Ctrl-C in its terminal
        try:
            code = daemon.wait(60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            raise
        log.close()
    text = (tmp_path / "daemon.log").read_text()
    assert code == 0 and "draining" in text and "stopped" in text, text[-3000:]
    assert "ERROR" not in text and "Traceback" not in text, text[-3000:]
