"""A Ray cluster whose nodes talk over a real, bandwidth-shaped network (Linux network namespaces).

Why: on one machine every Ray node shares loopback (12-14 Gbit/s for gloo here), so communication
costs are invisible. Here each node is a network namespace; two nodes are joined by one veth pair
(the same interface name at both ends), more by a bridge in a hub namespace. `tc qdisc ... tbf`
shapes every link end, so traffic between nodes moves at `rate` in each direction, and the rate
can be changed live (`set_rate`) for a bandwidth sweep on one cluster.

    with ShapedRayCluster(nodes=2, rate="200mbit") as c:
        c.run([sys.executable, "-m", "raylib", "run", "job.yaml"], node=0)   # a driver inside ns 0
        c.set_rate("1gbit")
        wire = c.tx_bytes(1)

Each node is a real `ray start` (head in namespace 0) with its own --temp-dir, --node-ip-address
and a custom resource "node<i>" (1 unit) that pins work to it. Everything runs with
RAY_AUTH_MODE=disabled (else `ray start --head` silently turns token auth on), GLOO_SOCKET_IFNAME=
<the node's interface> (else gloo binds the hostname -> 127.0.0.1, which does not leave a
namespace) and RAY_API_SERVER_ADDRESS=<this head's dashboard> (Train V2 asks the State API whether
its controller lives; the default lookup goes through the host-wide /tmp/ray and ps and can find
another cluster). Never `ray stop` (host-wide): teardown kills the namespaces' own pids.

Needs root, iproute2 and the tbf qdisc (netem does not work on this machine): `can_shape()` says
why not. Drivers run inside a namespace; results come back through the shared filesystem.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

GCS_PORT = 6379
DASHBOARD_PORT = 8265
PREFIX = "rlray"  # of every namespace this module creates: rlray<pid>s<seq>n<i> (hub: ...hub)
VENV_BIN = Path(sys.executable).parent
_SEQ = itertools.count()
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def rate_bits(rate: str | float) -> int:
    """tc's rate syntax in bits/s: "200mbit" (SI), "25mbps" (tc: bytes/s), or a number of bits/s."""
    if isinstance(rate, int | float):
        return int(rate)
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*", rate.lower())
    if not m:
        raise ValueError(f"rate {rate!r}: expected e.g. '200mbit', '1gbit', '25mbps' (bytes/s)")
    bits = float(m[1]) * _UNITS[m[2]] * (8 if m[3] == "bps" else 1)
    if bits < 8000:
        raise ValueError(f"rate {rate!r}: below 8 kbit/s")
    return int(bits)


def tbf_args(rate: str | float) -> list[str]:
    """tbf's burst must grow with the rate or the link runs below it: >= 4 ms of traffic (rate x 1 ms
    is the floor; 4 ms covers a HZ=250 timer), never under 256 KiB (measured: 187-192 Mbit/s on a
    200 Mbit/s link)."""
    bits = rate_bits(rate)
    burst = max(256 * 1024, bits * 4 // 8000)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "50ms"]


def _sh(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {(p.stderr or p.stdout).strip()}")
    return p


@functools.lru_cache(maxsize=1)
def can_shape() -> str | None:
    """None when ShapedRayCluster can run here, else why not (a test's skip reason)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"no `{tool}` (iproute2) on PATH"
    if not (VENV_BIN / "ray").exists() and not shutil.which("ray"):
        return "no `ray` executable next to this Python or on PATH"
    a, b = f"{PREFIX}{os.getpid()}probe0", f"{PREFIX}{os.getpid()}probe1"
    try:
        _sh("ip", "netns", "add", a)
        _sh("ip", "netns", "add", b)
        _sh("ip", "link", "add", "rlprobe", "netns", a, "type", "veth", "peer", "name", "rlprobe", "netns", b)
        _sh("ip", "netns", "exec", a, "tc", "qdisc", "add", "dev", "rlprobe", "root", *tbf_args("100mbit"))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot build a shaped veth pair between network namespaces here: {e}"
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    return None


def our_namespaces() -> list[str]:
    """Namespaces this module created in this process that still exist (teardown leaves none)."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    mine = f"{PREFIX}{os.getpid()}s"
    return [line.split()[0] for line in out.splitlines() if line.startswith(mine)]


class ShapedRayCluster:
    """`nodes` Ray nodes, one per network namespace, over links shaped to `rate` each way.

    resources_per_node: extra custom resources per node, merged over the default {"node<i>": 1}.
    env: extra environment for every `ray start` (and so every Ray worker) and every `run`.
    """

    def __init__(self, nodes: int = 2, rate: str | float = "200mbit", cpus_per_node: int = 1,
                 object_store_mb: int = 256, resources_per_node: Sequence[Mapping[str, float]] | None = None,
                 env: Mapping[str, str] | None = None, start_timeout: float = 120.0) -> None:
        if not 2 <= nodes <= 50:
            raise ValueError(f"nodes={nodes}: 2..50")
        if resources_per_node is not None and len(resources_per_node) != nodes:
            raise ValueError(f"resources_per_node has {len(resources_per_node)} entries for {nodes} nodes")
        rate_bits(rate)
        self.nodes, self.rate, self.cpus_per_node = nodes, rate, cpus_per_node
        self.object_store_mb, self.start_timeout = object_store_mb, start_timeout
        self.resources = [{f"node{i}": 1.0, **(resources_per_node[i] if resources_per_node else {})}
                          for i in range(nodes)]
        self.extra_env = dict(env or {})
        tag = f"{os.getpid()}s{next(_SEQ)}"
        self.namespaces = [f"{PREFIX}{tag}n{i}" for i in range(nodes)]
        self.hub = f"{PREFIX}{tag}hub" if nodes > 2 else None
        self.ifname = f"rl{os.getpid()}v"  # the node end of its link, in every node namespace (<= 15)
        octet = self._free_octet()
        self.node_ips = [f"10.216.{octet}.{i + 1}" for i in range(nodes)]
        self.temp_root: str | None = None
        self._shaped: list[tuple[str, str]] = []  # (namespace, interface) of every tbf qdisc
        self._created: list[str] = []

    # -- addresses ---------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        """The GCS address (RAY_ADDRESS) — reachable from inside the namespaces only."""
        return f"{self.node_ips[0]}:{GCS_PORT}"

    @property
    def dashboard_url(self) -> str:
        return f"http://{self.node_ips[0]}:{DASHBOARD_PORT}"

    @staticmethod
    def _free_octet() -> int:
        """A 10.216.X.0/24 no host interface uses (namespaces are isolated; this keeps logs unambiguous)."""
        taken = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        start = os.getpid() % 200
        for k in range(250):
            octet = 1 + (start + k) % 250
            if f" 10.216.{octet}." not in taken:
                return octet
        raise RuntimeError("no free 10.216.X.0/24")

    # -- lifecycle ---------------------------------------------------------------------------------

    def __enter__(self) -> ShapedRayCluster:
        try:
            self._build_network()
            self._start_ray()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build_network(self) -> None:
        for ns in [*self.namespaces, *([self.hub] if self.hub else [])]:
            _sh("ip", "netns", "add", ns)
            self._created.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if self.hub is None:  # one veth pair, the same name at both ends
            a, b = self.namespaces
            _sh("ip", "link", "add", self.ifname, "netns", a, "type", "veth", "peer", "name", self.ifname,
                "netns", b)
        else:  # a veth per node to a bridge in the hub
            bridge = f"rl{os.getpid()}b"
            _sh("ip", "-n", self.hub, "link", "add", bridge, "type", "bridge")
            _sh("ip", "-n", self.hub, "link", "set", bridge, "up")
            for i, ns in enumerate(self.namespaces):
                port = f"rl{os.getpid()}p{i}"
                _sh("ip", "link", "add", self.ifname, "netns", ns, "type", "veth", "peer", "name", port,
                    "netns", self.hub)
                _sh("ip", "-n", self.hub, "link", "set", port, "master", bridge)
                _sh("ip", "-n", self.hub, "link", "set", port, "up")
                self._shaped.append((self.hub, port))
        for ns, ip in zip(self.namespaces, self.node_ips, strict=True):
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", self.ifname)
            _sh("ip", "-n", ns, "link", "set", self.ifname, "up")
            self._shaped.append((ns, self.ifname))
        for ns, dev in self._shaped:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *tbf_args(self.rate))

    def env(self, node: int = 0, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment of everything started in `node`'s namespace: no inherited RAY_* (a host
        cluster's RAY_ADDRESS must not leak in), the venv first on PATH."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
        env.update(RAY_AUTH_MODE="disabled", GLOO_SOCKET_IFNAME=self.ifname, RAY_ADDRESS=self.address,
                   RAY_API_SERVER_ADDRESS=self.dashboard_url, RAY_USAGE_STATS_ENABLED="0")
        env.update(self.extra_env)
        env.update(extra or {})
        return env

    def _ray_start(self, node: int) -> None:
        ray = str(VENV_BIN / "ray") if (VENV_BIN / "ray").exists() else "ray"
        temp = os.path.join(self.temp_root, f"n{node}")
        args = [ray, "start", "--temp-dir", temp, "--node-ip-address", self.node_ips[node],
                "--num-cpus", str(self.cpus_per_node), "--resources", json.dumps(self.resources[node]),
                "--object-store-memory", str(self.object_store_mb << 20), "--disable-usage-stats"]
        if node == 0:
            args += ["--head", "--port", str(GCS_PORT), "--include-dashboard", "true",
                     "--dashboard-host", self.node_ips[0], "--dashboard-port", str(DASHBOARD_PORT)]
        else:
            args += ["--address", self.address]
        env = self.env(node)
        env.pop("RAY_ADDRESS")  # `ray start` would read it as the cluster to join
        p = subprocess.run(["ip", "netns", "exec", self.namespaces[node], *args], env=env,
                           capture_output=True, text=True, timeout=self.start_timeout)
        if p.returncode:
            raise RuntimeError(f"ray start on node {node} ({self.namespaces[node]}) exited {p.returncode}:\n"
                               f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")

    def _start_ray(self) -> None:
        self.temp_root = tempfile.mkdtemp(prefix=f"rlns{os.getpid()}-", dir="/tmp")  # short: socket paths
        for node in range(self.nodes):
            self._ray_start(node)
        self._wait_alive()

    def _wait_alive(self) -> None:
        """Poll the head's State API (from inside namespace 0) until every node is ALIVE."""
        deadline = self.start_timeout
        probe = (
            "import json, sys, time, urllib.request\n"
            "url, want, deadline = sys.argv[1], int(sys.argv[2]), time.monotonic() + float(sys.argv[3])\n"
            "seen = 'no answer'\n"
            "while time.monotonic() < deadline:\n"
            "    try:\n"
            "        with urllib.request.urlopen(url + '/api/v0/nodes?limit=1000', timeout=5) as r:\n"
            "            nodes = json.load(r)['data']['result']['result']\n"
            "        seen = sorted((n['node_ip'], n['state']) for n in nodes)\n"
            "        if sum(n['state'] == 'ALIVE' for n in nodes) >= want:\n"
            "            sys.exit(0)\n"
            "    except Exception as e:\n"
            "        seen = repr(e)\n"
            "    time.sleep(0.5)\n"  # a poll interval, not a stand-in for synchronisation
            "print(seen)\n"
            "sys.exit(1)\n"
        )
        p = self.run([sys.executable, "-c", probe, self.dashboard_url, str(self.nodes), str(deadline)],
                     timeout=deadline + 30)
        if p.returncode:
            logs = sorted(Path(self.temp_root).glob("n*/session_latest/logs/raylet.err"))
            tail = "".join(f"\n--- {f}:\n{f.read_text()[-1500:]}" for f in logs)
            raise RuntimeError(f"not all {self.nodes} Ray nodes alive within {deadline:.0f} s (state API at "
                               f"{self.dashboard_url}: {p.stdout.strip()} {p.stderr[-2000:]}){tail}")

    def close(self) -> None:
        """Kill every process in our namespaces (workers' nodes first, the head last), delete the
        namespaces (which takes the veths and qdiscs along) and the temp dirs. Idempotent."""
        errors = []
        for ns in reversed(self._created):
            try:
                _kill_namespace(ns)
            except Exception as e:  # keep going: the rest must still go
                errors.append(f"{ns}: {e}")
        for ns in reversed(self._created):
            p = subprocess.run(["ip", "netns", "del", ns], capture_output=True, text=True)
            if p.returncode and ns in _list_namespaces():
                errors.append(f"ip netns del {ns}: {p.stderr.strip()}")
        self._created, self._shaped = [], []
        if self.temp_root:
            shutil.rmtree(self.temp_root, ignore_errors=True)
            self.temp_root = None
        if errors:
            raise RuntimeError("ShapedRayCluster teardown: " + "; ".join(errors))

    # -- use ---------------------------------------------------------------------------------------

    def _argv(self, argv: Sequence[str], node: int) -> list[str]:
        if not 0 <= node < self.nodes:
            raise IndexError(f"node {node} of {self.nodes}")
        return ["ip", "netns", "exec", self.namespaces[node], *map(str, argv)]

    def run(self, argv: Sequence[str], node: int = 0, env: Mapping[str, str] | None = None,
            timeout: float | None = 300, **kwargs) -> subprocess.CompletedProcess:
        """Run `argv` inside `node`'s namespace (RAY_ADDRESS set: a driver joins this cluster);
        output captured as text unless kwargs say otherwise."""
        kwargs.setdefault("capture_output", "stdout" not in kwargs and "stderr" not in kwargs)
        kwargs.setdefault("text", True)
        return subprocess.run(self._argv(argv, node), env=self.env(node, env), timeout=timeout, **kwargs)

    def popen(self, argv: Sequence[str], node: int = 0, env: Mapping[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start `argv` inside `node`'s namespace without waiting (e.g. one process per node at once).
        Teardown kills it if it still runs."""
        return subprocess.Popen(self._argv(argv, node), env=self.env(node, env), **kwargs)

    def set_rate(self, rate: str | float) -> None:
        """Change every link's rate, live (Ray keeps running)."""
        rate_bits(rate)
        for ns, dev in self._shaped:
            _sh("ip", "netns", "exec", ns, "tc", "qdisc", "change", "dev", dev, "root", *tbf_args(rate))
        self.rate = rate

    def pids(self, node: int) -> list[int]:
        """Live processes in `node`'s namespace (Ray's daemons and workers, drivers run there)."""
        return [p for p in _pids(self.namespaces[node]) if _alive(p)]

    def _stat(self, node: int, name: str) -> int:
        p = _sh(*self._argv(["cat", f"/sys/class/net/{self.ifname}/statistics/{name}"], node))
        return int(p.stdout)

    def tx_bytes(self, node: int) -> int:
        """Bytes `node` has sent on its link (IP headers included; Ray's own traffic too)."""
        return self._stat(node, "tx_bytes")

    def rx_bytes(self, node: int) -> int:
        return self._stat(node, "rx_bytes")


def _list_namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _pids(ns: str) -> list[int]:
    p = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(x) for x in p.stdout.split()] if p.returncode == 0 else []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill_namespace(ns: str, grace: float = 2.0, deadline: float = 30.0) -> None:
    """SIGTERM every pid in `ns` (raylets first, gcs_server last, so nothing restarts what just
    went), wait up to `grace` (gcs_server and the head's monitor linger for > 5 s), SIGKILL what
    is left, until `ip netns pids` is empty."""
    def rank(pid: int) -> int:
        try:
            name = psutil.Process(pid).name()
        except psutil.Error:
            return 1
        return 0 if "raylet" in name else 2 if "gcs_server" in name else 1

    end, sig = time.monotonic() + deadline, signal.SIGTERM
    term_until = time.monotonic() + grace
    while True:
        pids = [p for p in _pids(ns) if _alive(p)]
        if not pids:
            return
        if time.monotonic() > end:
            raise RuntimeError(f"processes {pids} in {ns} survive SIGKILL")
        if time.monotonic() > term_until:
            sig = signal.SIGKILL
        for pid in sorted(pids, key=rank):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        procs = []
        for pid in pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=0.5)  # returns as soon as all are gone
