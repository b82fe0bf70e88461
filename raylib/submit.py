"""`raylib submit`: run a JobSpec on a Ray cluster through the Ray Jobs API.

    raylib submit jobs/configs/tiny.yaml --address http://head:8265 --set run.steps=3 \
        --env AWS_ACCESS_KEY_ID --env AWS_SECRET_ACCESS_KEY --env AWS_ENDPOINT_URL

It uploads the checkout as the job's working_dir (without .venv, runs, .raylib, .git), runs
`python -m raylib run CONFIG --no-progress --set ...` as the entrypoint (any model and task: the
config says which), streams the job's
logs, waits, and returns the job's summary (the job prints `summary: <path>`; summary.json is read
locally when the cluster shares this machine's files, else fetched by a second, tiny job).

Environment variables named with `--env` are passed to the job by name through runtime_env
env_vars: their values are never printed or logged here. (Ray stores a job's runtime_env with the
job: anyone allowed to use the cluster's dashboard can read it. Token auth limits who that is.)

Token auth (Ray 2.60 turns it on for `ray start --head`): with RAY_AUTH_MODE=token Ray's client
sends the token itself (RAY_AUTH_TOKEN, else the file RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token).
With RAY_AUTH_MODE unset, `raylib submit` first asks the dashboard without a token and, only when
it answers 401, sends the token found in those same places.

The job spec's schema is checked here before anything is uploaded (a typo in a key or a --set);
what needs the cluster (the built data, the model against it, DeepSpeed's checks) is checked by the
job itself within seconds: a FAILED job whose error names the key and the fix, and `raylib submit`
exits non-zero with it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

ENTRYPOINT = ("python", "-m", "raylib", "run")
"""The generic entrypoint run by the job (in the working dir: the checkout)."""
PACKAGE_MARKER = "raylib/cli.py"
"""What makes a directory a raylib checkout (relative to it)."""
WORKING_DIR_EXCLUDES = [
    ".venv", "venv", ".git", "runs", ".raylib", "__pycache__", "*.egg-info", ".pytest_cache",
    ".ruff_cache", "bench/results", ".ipynb_checkpoints",
]
"""Never uploaded with the working dir (virtualenvs, run outputs, built data, caches)."""
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
SUMMARY_LINE = re.compile(r"^summary: (?P<path>\S.*)$", re.MULTILINE)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_RAY_ENV_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


class SubmitError(ValueError):
    """A submission that cannot be made as asked. The message names the problem and the fix."""


@dataclass
class SubmitResult:
    """What became of a submitted job."""

    job_id: str
    status: str
    """SUCCEEDED, FAILED or STOPPED (PENDING/RUNNING when not waited for)."""
    address: str
    """The dashboard URL the job was submitted to."""
    summary: dict[str, Any] | None = None
    """The run's summary.json (SUCCEEDED jobs)."""
    summary_path: str | None = None
    """Where the job wrote summary.json (a path on the node that ran the job's driver)."""
    error: str | None = None
    """Why the job failed: the job's own error lines and Ray's message."""
    logs: str = field(default="", repr=False)

    @property
    def ok(self) -> bool:
        return self.status == "SUCCEEDED"

    def __repr__(self) -> str:
        extra = ""
        if self.summary:
            extra = (f", steps={self.summary.get('steps')}, "
                     f"final_loss={self.summary.get('final_loss')}")
        elif self.error:
            first = self.error.strip().splitlines()[0] if self.error.strip() else ""
            extra = f", error={first!r}"
        return f"SubmitResult(job_id={self.job_id!r}, status={self.status!r}{extra})"


# -- building the submission --------------------------------------------------------------------


def default_working_dir() -> Path:
    """The checkout this raylib comes from (it holds jobs/), else the current directory."""
    here = Path(__file__).resolve().parents[1]
    return here if _is_checkout(here) else Path.cwd()


def _is_checkout(path: Path) -> bool:
    """A raylib source checkout: the package with its pyproject.toml beside it. The package
    alone is not one: a regular install's parent is site-packages, and uploading that would make
    every config "outside the working dir"."""
    pyproject = path / "pyproject.toml"
    try:
        named = re.search(r'^name\s*=\s*"raylib', pyproject.read_text(), re.MULTILINE) is not None
    except OSError:
        return False
    return named and (path / PACKAGE_MARKER).is_file()


def build_submission(
    config: str | os.PathLike,
    *,
    overrides: Sequence[str] = (),
    env: Sequence[str] = (),
    working_dir: str | os.PathLike | None = None,
    environ: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The entrypoint and runtime_env of a job (keyword arguments of JobSubmissionClient.submit_job).

    config: the JobSpec YAML, inside the working dir (the job reads it there).
    env: names of environment variables whose values (taken from `environ`, default os.environ)
    the job gets. A name that is not set is an error; NAME=VALUE is refused (no secrets on
    command lines).
    """
    environ = os.environ if environ is None else environ
    wd = Path(working_dir).resolve() if working_dir is not None else default_working_dir()
    if not (wd / PACKAGE_MARKER).is_file():
        raise SubmitError(
            f"working dir {str(wd)!r} has no {PACKAGE_MARKER}; run from the raylib checkout "
            "or pass --working-dir CHECKOUT"
        )
    cfg = Path(config)
    cfg_abs = (cfg if cfg.is_absolute() else Path.cwd() / cfg).resolve()
    if not cfg_abs.is_file() and not cfg.is_absolute() and (wd / cfg).is_file():
        cfg_abs = (wd / cfg).resolve()
    if not cfg_abs.is_file():
        raise SubmitError(f"config file {str(config)!r} not found")
    try:
        rel = cfg_abs.relative_to(wd)
    except ValueError:
        raise SubmitError(
            f"config {str(cfg_abs)!r} is outside the working dir {str(wd)!r}, so the job could "
            "not read it; copy it under jobs/configs/ (or pass --working-dir)"
        ) from None
    # Ray's own matcher (gitignore rules: "runs" excludes a runs/ at any depth), applied as Ray
    # applies it while packing the working dir: to the file and to every directory above it
    from ray._private.runtime_env.packaging import _get_excludes

    excluded = _get_excludes(wd, WORKING_DIR_EXCLUDES)
    hit = next((p for p in [*reversed(rel.parents[:-1]), rel] if excluded(wd / p)), None)
    if hit is not None:
        raise SubmitError(f"config {str(rel)!r} lies in {str(hit)!r}, which is not uploaded; "
                          "copy it under jobs/configs/")
    # the spec is pure schema: a typo fails here, before anything is uploaded (read from the working
    # dir, as the job reads it there)
    from raylib.spec import JobSpec

    with contextlib.chdir(wd):
        try:
            JobSpec.from_yaml(rel, overrides=list(overrides))
        except ValueError as e:
            raise SubmitError(str(e)) from None

    env_vars: dict[str, str] = {}
    for name in env:
        if "=" in name:
            raise SubmitError(
                f"--env takes a variable NAME, not NAME=VALUE ({name.split('=', 1)[0]}=...): "
                "export it in this shell and pass --env NAME, so the value stays off the "
                "command line"
            )
        if not _ENV_NAME.match(name):
            raise SubmitError(f"--env {name!r} is not an environment variable name")
        if name not in environ:
            raise SubmitError(f"--env {name}: {name} is not set in this environment; export it "
                              "first (its value is sent to the job, never printed)")
        env_vars[name] = environ[name]

    args = [*ENTRYPOINT, rel.as_posix(), "--no-progress"]
    for item in overrides:
        if "=" not in item:
            raise SubmitError(f"--set {item!r}: expected key=value, e.g. strategy.zero_stage=3")
        args += ["--set", item]
    return {
        "entrypoint": shlex.join(args),
        "runtime_env": {
            "working_dir": str(wd),
            "excludes": list(WORKING_DIR_EXCLUDES),
            **({"env_vars": env_vars} if env_vars else {}),
        },
    }


# -- reaching the cluster ------------------------------------------------------------------------


@contextlib.contextmanager
def _explicit_address_env(address: str | None) -> Iterator[None]:
    """Ray's job client lets RAY_API_SERVER_ADDRESS / RAY_ADDRESS override an explicit address;
    here an explicit --address wins, so hide them while the client resolves it."""
    if address is None:
        yield
        return
    saved = {k: os.environ.pop(k) for k in _RAY_ENV_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def resolve_address(address: str | None = None) -> str:
    """The dashboard URL (http://host:port) of `address`; None: RAY_API_SERVER_ADDRESS, else
    RAY_ADDRESS, else the local cluster Ray finds (as `ray job submit` does)."""
    from ray.dashboard.utils import get_address_for_submission_client

    if address in (None, "auto") and not any(os.environ.get(k) for k in _RAY_ENV_VARS):
        # Finding the local cluster goes through its GCS: like ray.init() for a cluster found
        # locally, use the local token when there is one.
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )

        maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
    with _explicit_address_env(address):
        return get_address_for_submission_client(address).rstrip("/")


def token_source() -> str | None:
    """Where Ray would load an auth token from (never the token itself), or None."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH")
    if path:
        return path if Path(path).expanduser().is_file() else None
    default = Path.home() / ".ray" / "auth_token"
    return str(default) if default.is_file() else None


def _load_token() -> str | None:
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    src = token_source()
    if src is None:
        return None
    return Path(src).expanduser().read_text().strip() or None


def auth_headers(url: str, timeout_s: float = 10.0) -> dict[str, str]:
    """Headers that authenticate to the dashboard at `url` (empty when none are needed, or when
    RAY_AUTH_MODE is set and Ray's own client adds them). Raises SubmitError with the fix."""
    import requests

    if os.environ.get("RAY_AUTH_MODE"):
        return {}
    try:
        r = requests.get(f"{url}/api/version", timeout=timeout_s)
    except requests.RequestException as e:
        raise SubmitError(
            f"cannot reach the Ray dashboard at {url} ({type(e).__name__}); check the address "
            "(--address http://HEAD:8265, or RAY_API_SERVER_ADDRESS) and that the cluster is up "
            "(from outside the cluster's network: an SSH tunnel or kubectl port-forward to 8265)"
        ) from None
    if r.status_code != 401:
        return {}
    token = _load_token()
    if token is None:
        raise SubmitError(
            f"the cluster at {url} requires a Ray auth token and none was found; copy the head "
            "node's ~/.ray/auth_token here and set RAY_AUTH_TOKEN_PATH=<that file> (or "
            "RAY_AUTH_TOKEN), plus RAY_AUTH_MODE=token"
        )
    return {"Authorization": f"Bearer {token}"}


def client(address: str | None = None):
    """A JobSubmissionClient for `address` (see resolve_address), authenticated if needed."""
    from ray.job_submission import JobSubmissionClient

    try:
        url = resolve_address(address)
    except Exception as e:  # ConnectionError, ray.exceptions.AuthenticationError, ValueError
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise SubmitError(
            f"no Ray cluster found at {address or 'RAY_API_SERVER_ADDRESS/RAY_ADDRESS/local'} "
            f"({first}); pass --address http://HEAD:8265 (the dashboard URL)"
        ) from None
    headers = auth_headers(url)
    with _explicit_address_env(url):
        try:
            return JobSubmissionClient(url, headers=headers or None)
        except (ConnectionError, RuntimeError) as e:
            msg = str(e)
            if "403" in msg or "Forbidden" in msg:
                raise SubmitError(
                    f"the cluster at {url} rejected the auth token (from {token_source()}); use "
                    "the token of that cluster's head node (~/.ray/auth_token there)"
                ) from None
            if "401" in msg or "Authentication required" in msg:
                raise SubmitError(
                    f"the cluster at {url} requires a Ray auth token: set RAY_AUTH_MODE=token and "
                    "RAY_AUTH_TOKEN_PATH=<a copy of the head node's ~/.ray/auth_token>"
                ) from None
            raise


# -- submitting, following, summarising ----------------------------------------------------------


def submit(
    config: str | os.PathLike,
    *,
    address: str | None = None,
    overrides: Sequence[str] = (),
    env: Sequence[str] = (),
    working_dir: str | os.PathLike | None = None,
    wait: bool = True,
    out: TextIO | None = None,
    timeout_s: float | None = None,
    submission_id: str | None = None,
) -> SubmitResult:
    """Submit `config` as a Ray job; with wait, stream its logs to `out` and return its outcome.

    timeout_s: stop the job (and return STOPPED) if it is not done by then.
    """
    out = sys.stdout if out is None else out
    job = build_submission(config, overrides=overrides, env=env, working_dir=working_dir)
    jobs = client(address)
    url = jobs.get_address()
    job_id = _submit_when_agent_ready(
        jobs, entrypoint=job["entrypoint"], runtime_env=job["runtime_env"],
        submission_id=submission_id, metadata={"raylib": "submit", "config": str(config)},
    )
    names = sorted(job["runtime_env"].get("env_vars", {}))
    print(f"raylib submit: job {job_id} on {url}: {job['entrypoint']}"
          + (f" (env: {', '.join(names)})" if names else ""), file=sys.stderr)
    if not wait:
        return SubmitResult(job_id=job_id, status=str(jobs.get_job_status(job_id)), address=url)

    logs = _follow(jobs, job_id, out, timeout_s)
    status = _wait_terminal(jobs, job_id, deadline=time.monotonic() + 60)
    info = jobs.get_job_info(job_id)
    logs = jobs.get_job_logs(job_id) or logs  # the complete log, also when streaming broke off
    result = SubmitResult(job_id=job_id, status=status, address=url, logs=logs)
    if status == "SUCCEEDED":
        paths = [m.group("path").strip() for m in SUMMARY_LINE.finditer(logs)]
        if paths:
            result.summary_path = paths[-1]
            result.summary = fetch_summary(jobs, result.summary_path,
                                           not_before_s=(info.start_time or 0) / 1000)
    else:
        result.error = job_error(logs, info.message)
    return result


def _follow(jobs, job_id: str, out: TextIO, timeout_s: float | None) -> str:
    chunks: list[str] = []

    async def tail() -> None:
        async for lines in jobs.tail_job_logs(job_id):
            chunks.append(lines)
            out.write(lines)
            out.flush()

    async def tail_with_timeout() -> None:
        if timeout_s is None:
            await tail()
        else:
            await asyncio.wait_for(tail(), timeout_s)

    try:
        _run_async(tail_with_timeout)
    except (asyncio.TimeoutError, TimeoutError):
        print(f"raylib submit: job {job_id} not done after {timeout_s:g} s: stopping it",
              file=sys.stderr)
        jobs.stop_job(job_id)
    except RuntimeError as e:  # the log stream broke off; the status poll below still tells
        print(f"raylib submit: log stream of {job_id} ended early ({e})", file=sys.stderr)
    return "".join(chunks)


def _run_async(make_coro) -> None:
    """asyncio.run(make_coro()), also from a thread that already runs an event loop (a Jupyter
    kernel): then in a helper thread, joined in short waits so Ctrl-C still reaches us."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        asyncio.run(make_coro())
        return
    failure: list[BaseException] = []

    def target() -> None:
        try:
            asyncio.run(make_coro())
        except BaseException as e:  # handed to the caller's thread
            failure.append(e)

    thread = threading.Thread(target=target, daemon=True, name="raylib-submit-logs")
    thread.start()
    while thread.is_alive():
        thread.join(0.5)
    if failure:
        raise failure[0]


def _wait_terminal(jobs, job_id: str, deadline: float) -> str:
    while True:
        status = str(jobs.get_job_status(job_id))
        if status in TERMINAL or time.monotonic() > deadline:
            return status
        time.sleep(0.5)


def job_error(logs: str, message: str | None) -> str:
    """The job's own error lines (the raylib CLI prints `raylib: error: ...` and its details;
    else the last traceback line), then Ray's message about the job."""
    lines = logs.rstrip().splitlines()
    picked: list[str] = []
    for i, line in enumerate(lines):
        if line.startswith("raylib: error:"):
            picked = [line]
            picked += [x for x in lines[i + 1:i + 40] if x.startswith("  ")]
    if not picked:
        tb = [x for x in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Failed|Stopped)\b", x)]
        picked = tb[-1:]
    if message:  # Ray's first line (the rest repeats the end of the logs)
        picked.append(message.strip().splitlines()[0])
    return "\n".join(picked)


def fetch_summary(jobs, path: str, not_before_s: float = 0.0) -> dict[str, Any] | None:
    """summary.json written by the job at `path` on the node that ran its driver.

    Read here when this machine sees that file (a local cluster or a shared file system) and it
    was written by this job; else read on the cluster by a second, tiny job."""
    p = Path(path)
    try:
        if p.is_file() and p.stat().st_mtime >= not_before_s - 2:
            return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        pass
    return fetch_remote_file_json(jobs, path)


def _submit_when_agent_ready(jobs, wait_s: float = 120, **kwargs) -> str:
    """submit_job, retried while a freshly started head's job agent is not up yet (HTTP 500 "No
    available agent to submit job"); any other error is raised at once."""
    deadline, delay = time.monotonic() + wait_s, 0.5
    while True:
        try:
            return jobs.submit_job(**kwargs)
        except RuntimeError as e:
            if "No available agent" not in str(e) or time.monotonic() > deadline:
                raise
        time.sleep(delay)
        delay = min(delay * 2, 5.0)


def fetch_remote_file_json(jobs, path: str, timeout_s: float = 120) -> dict[str, Any] | None:
    """Read a JSON file on the cluster's head node (where job drivers run) with a tiny job."""
    code = ("import sys; sys.stdout.write('RAYLIB-JSON-BEGIN' + open(sys.argv[1]).read() "
            "+ 'RAYLIB-JSON-END')")
    job_id = _submit_when_agent_ready(jobs, entrypoint=shlex.join(["python", "-c", code, path]),
                                      metadata={"raylib": "fetch-summary"})
    status = _wait_terminal(jobs, job_id, deadline=time.monotonic() + timeout_s)
    logs = jobs.get_job_logs(job_id)
    m = re.search(r"RAYLIB-JSON-BEGIN(.*)RAYLIB-JSON-END", logs, re.DOTALL)
    if status != "SUCCEEDED" or m is None:
        return None
    return json.loads(m.group(1))


# -- the command ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="JobSpec YAML inside the checkout (e.g. jobs/configs/tiny.yaml)")
    p.add_argument("--address", help="Ray dashboard URL, e.g. http://head:8265 (default: "
                   "RAY_API_SERVER_ADDRESS, else RAY_ADDRESS, else the local cluster)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field in the job, e.g. run.steps=100")
    p.add_argument("--env", dest="env", action="append", default=[], metavar="NAME",
                   help="pass this environment variable to the job by name, e.g. "
                   "AWS_SECRET_ACCESS_KEY (its value is never printed)")
    p.add_argument("--working-dir", help="checkout to upload (default: the one raylib runs from)")
    p.add_argument("--no-wait", action="store_true", help="submit and return the job id")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop the job if it is not done after this long")


def main(args: argparse.Namespace) -> int:
    """`raylib submit`: 0 when the job SUCCEEDED (or was submitted, with --no-wait), else 1."""
    try:
        result = submit(args.config, address=args.address, overrides=args.overrides,
                        env=args.env, working_dir=args.working_dir, wait=not args.no_wait,
                        timeout_s=args.timeout)
    except KeyboardInterrupt:
        print("\nraylib submit: stopped following; the job keeps running "
              "(`ray job stop <id>` stops it)", file=sys.stderr)
        return 130
    if args.no_wait:
        print(result.job_id)
        return 0
    if not result.ok:
        print(f"raylib submit: job {result.job_id} {result.status}", file=sys.stderr)
        if result.error:
            print(result.error, file=sys.stderr)
        return 1
    print(f"raylib submit: job {result.job_id} SUCCEEDED", file=sys.stderr)
    if result.summary is not None:
        s = result.summary
        keys = ("steps", "world_size", "zero_stage", "initial_loss", "final_loss",
                "samples_per_s", "checkpoint_uri")
        print(json.dumps({k: s.get(k) for k in keys}, indent=2))
        print(f"summary: {result.summary_path}")
    elif result.summary_path:
        print(f"summary: {result.summary_path} (not readable from here)")
    return 0


__all__ = ["SubmitError", "SubmitResult", "build_submission", "client", "submit"]
