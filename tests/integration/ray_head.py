"""A real `ray start --head` for tests, isolated from every other Ray cluster on this machine.

Own --temp-dir (so /tmp/ray/ray_current_cluster is never touched), free ports for every listener,
a scrubbed environment (no RAY_ADDRESS inherited), the venv first on PATH (the job entrypoint's
`python` is the venv's, as on a node where raylib is installed). `ray start --block` runs in a
new session: stop() sends SIGTERM to that pid (Ray then shuts its node down), then SIGKILLs by pid
whatever process of that session is still alive. Never `ray stop`: it kills every Ray cluster of
this user, including other test sessions'.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

VENV_BIN = Path(sys.executable).parent
PORT_FLAGS = ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
              "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
              "node-manager-port", "object-manager-port")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int = 100) -> tuple[int, int]:
    """n consecutive ports that are free now (for --min/--max-worker-port)."""
    for _ in range(50):
        start = free_port()
        if start + n > 65000:
            continue
        socks = []
        try:
            for p in range(start, start + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return start, start + n - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def token_headers() -> dict[str, str]:
    """The default token file: `ray start --head` turns token auth on when it exists."""
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    return {"Authorization": f"Bearer {path.read_text().strip()}"} if path.is_file() else {}


class RayHead:
    def __init__(self, num_cpus: int = 4, object_store_mb: int = 300,
                 extra_args: list[str] | None = None, env: dict[str, str] | None = None):
        self.num_cpus, self.object_store_mb = num_cpus, object_store_mb
        self.extra_args, self.extra_env = extra_args or [], env or {}
        self.temp_dir = tempfile.mkdtemp(prefix="rl-head-", dir="/tmp")  # short: socket paths
        self.worker_ports = free_port_range()
        self.ports: dict[str, int] = {}
        for flag in PORT_FLAGS:  # distinct, and outside the worker port range
            port = free_port()
            while port in self.ports.values() or self.worker_ports[0] <= port <= self.worker_ports[1]:
                port = free_port()
            self.ports[flag] = port
        self.proc: subprocess.Popen | None = None

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.ports['port']}"

    @property
    def dashboard_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['dashboard-port']}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not (k.startswith("RAY_") and k not in ("RAY_AUTH_TOKEN_PATH",))}
        env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
        env.update(self.extra_env)
        return env

    def start(self, timeout_s: float = 120) -> RayHead:
        lo, hi = self.worker_ports
        cmd = [str(VENV_BIN / "ray"), "start", "--head", "--block", "--temp-dir", self.temp_dir,
               "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1",
               "--num-cpus", str(self.num_cpus),
               "--object-store-memory", str(self.object_store_mb * 2**20),
               "--min-worker-port", str(lo), "--max-worker-port", str(hi),
               "--disable-usage-stats", *self.extra_args]
        for flag, port in self.ports.items():
            cmd += [f"--{flag}", str(port)]
        self.log = Path(self.temp_dir) / "ray-start.log"
        self.proc = subprocess.Popen(cmd, env=self.env(), stdout=self.log.open("w"),
                                     stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while True:  # up = the dashboard answers an authenticated request for the job list
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited {self.proc.returncode}:\n{self.log.read_text()}")
            try:
                r = requests.get(f"{self.dashboard_url}/api/jobs/", headers=token_headers(),
                                 timeout=2)
                if r.status_code == 200:
                    return self
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"the Ray head did not come up in {timeout_s} s")
            time.sleep(0.5)

    def session_pids(self) -> list[int]:
        """Processes of the session `ray start` leads (it was started with start_new_session)."""
        if self.proc is None:
            return []
        pids = []
        for p in psutil.process_iter(["pid"]):
            try:
                if os.getsid(p.pid) == self.proc.pid:
                    pids.append(p.pid)
            except (ProcessLookupError, PermissionError):
                continue
        return pids

    def stop(self, grace_s: float = 1) -> None:
        """SIGTERM every process of the session `ray start` leads (the node it started, nodes an
        autoscaler started), SIGKILL those still alive after grace_s; all by pid. A test's cluster
        is thrown away: a SIGTERMed `ray start --block` alone shuts its node down gracefully, which
        took over 12 s here, and some of its workers outlive a SIGTERM by seconds."""
        if self.proc is not None:
            for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
                for pid in self.session_pids():
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                deadline = time.monotonic() + wait_s
                while time.monotonic() < deadline:
                    self.proc.poll()  # reap `ray start` itself once it exits
                    if not self.session_pids():
                        break
                    time.sleep(0.2)
                if not self.session_pids():
                    break
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            self.proc = None
        shutil.rmtree(self.temp_dir, ignore_errors=True)
