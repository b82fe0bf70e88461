"""`raylib run --embedded-s3`: its SeaweedFS never outlives the process, whatever ends it.

No SeaweedFS is started here: `weed` is a stand-in script (a sleep in its own session, as weed
runs) and the readiness probe is skipped; the real server is exercised by tests/integration."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from raylib.data import s3server

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

# `raylib run --embedded-s3` in small: the server is up while the run goes on, then a signal comes
RUN = textwrap.dedent("""
    import sys, time
    from raylib.data import s3server

    s3server.find_weed = lambda: sys.argv[2]
    s3server.SeaweedFS._wait_ready = lambda self, deadline: None
    s3server.SeaweedFS.filesystem = lambda self: None
    with s3server.embedded_s3(sys.argv[1]) as server:
        print(server.pid, flush=True)
        time.sleep(60)
""")


@pytest.fixture
def fake_weed(tmp_path) -> str:
    weed = tmp_path / "weed"
    weed.write_text("#!/bin/sh\nexec sleep 60\n")
    weed.chmod(0o755)
    return str(weed)


def running(pid: int) -> bool:
    """Alive and not a zombie (a container's init may never reap an orphan)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_terminated_run_stops_its_weed(sig, tmp_path, fake_weed):
    with child_and_weed(RUN, str(tmp_path / "s3"), fake_weed) as (proc, weed):
        assert running(weed)
        proc.send_signal(sig)  # `timeout`, `kill`, a closed terminal
        assert proc.wait(timeout=30) == 128 + sig
        assert not running(weed), f"weed (pid {weed}) outlived the run that started it"


@contextlib.contextmanager
def child_and_weed(code: str, *args: str):
    """A child python running `code`, which prints its weed's pid first: (child, weed pid). Both
    are killed at the end if still there."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, stdout=subprocess.PIPE, text=True)
    weed = None
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), f"the child did not start its server: {line!r}"
        weed = int(line)
        yield proc, weed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if weed is not None and running(weed):
            os.kill(weed, signal.SIGKILL)


def test_the_handlers_and_environment_come_back_after_the_server(tmp_path, fake_weed, monkeypatch):
    monkeypatch.setattr(s3server, "find_weed", lambda: fake_weed)
    monkeypatch.setattr(s3server.SeaweedFS, "_wait_ready", lambda self, deadline: None)
    monkeypatch.setattr(s3server.SeaweedFS, "filesystem", lambda self: None)
    for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(k, raising=False)
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    with s3server.embedded_s3(tmp_path / "s3") as server:
        assert all(signal.getsignal(sig) is not h for sig, h in before.items())
        assert os.environ["AWS_ENDPOINT_URL"] == server.endpoint
    assert not server.running()
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert "AWS_ENDPOINT_URL" not in os.environ and "AWS_ACCESS_KEY_ID" not in os.environ

    def fail(self, timeout=60.0):
        raise s3server.S3ServerError("SeaweedFS exited with code 1; log weed.log")

    monkeypatch.setattr(s3server.SeaweedFS, "start", fail)
    with pytest.raises(s3server.S3ServerError), s3server.embedded_s3(tmp_path / "s3"):
        pass
    assert {sig: signal.getsignal(sig) for sig in before} == before
    assert "AWS_ACCESS_KEY_ID" not in os.environ  # the generated pair is not left behind


# A parent that dies without a chance to stop weed (SIGKILL, the OOM killer); the server started
# on its main thread, or on a thread that ended long before (weed must outlive that thread)
KILLED = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from raylib.data import s3server

    def wait_ready(self, deadline):  # as start() waits for the real weed to answer
        while not (self.data_dir / "fake-weed.log").exists() and time.monotonic() < deadline:
            time.sleep(0.01)

    s3server.find_weed = lambda: sys.argv[2]
    s3server.SeaweedFS._wait_ready = wait_ready
    server = s3server.SeaweedFS(sys.argv[1], access_key="k", secret_key="s")
    if sys.argv[3] == "thread":
        t = threading.Thread(target=server.start)
        t.start()
        t.join()
        deadline = time.monotonic() + 30
        while Path(f"/proc/self/task/{t.native_id}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # until the kernel is done with the thread (and its children's signals)
    else:
        server.start()
    print(server.pid, flush=True)
    time.sleep(60)
""")

# Records the SIGTERM it gets and its parent at that moment (in its cwd, the data directory)
PY_WEED = """#!{python}
import os, signal, sys, time
def on_term(*_):
    with open("fake-weed.log", "w") as f:
        f.write(f"TERM {{os.getppid()}}")
    sys.exit(143)
signal.signal(signal.SIGTERM, on_term)
with open("fake-weed.log", "w") as f:
    f.write("ready")
time.sleep(60)
"""


def poll(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
@pytest.mark.parametrize("where", ["main", "thread"])
def test_a_killed_parent_takes_its_weed_with_it(where, tmp_path):
    weed_bin = tmp_path / "weed"
    weed_bin.write_text(PY_WEED.format(python=sys.executable))
    weed_bin.chmod(0o755)
    data = tmp_path / "s3"
    log = data / "fake-weed.log"
    with child_and_weed(KILLED, str(data), str(weed_bin), where) as (proc, weed):
        assert poll(lambda: log.exists() and log.read_text() or not running(weed))
        assert running(weed) and log.read_text() == "ready", \
            f"weed ended with the thread that started it: {log.read_text() if log.exists() else ''!r}"
        proc.kill()  # no handler, no finally, no atexit
        proc.wait()
        assert poll(lambda: not running(weed)), f"weed (pid {weed}) outlived its SIGKILLed parent"
        got, parent = log.read_text().split()
        assert got == "TERM" and int(parent) != proc.pid, "the SIGTERM came before the parent died"
