"""`raylib doctor`'s checks, one at a time, on this machine (no Ray cluster: the check against
a real head is in tests/integration/test_submit.py).

Real where the machine allows it: installed versions, the disk, NVML (there is no NVIDIA driver
here, which is the CPU-machine case), an HTTP endpoint on loopback. NVML is replaced by a stand-in
only to exercise the GPU branches, because no GPU can exist on this machine.
"""

from __future__ import annotations

import http.server
import json
import socket
import threading
from importlib import metadata
from types import SimpleNamespace

import pytest

from raylib import cli, doctor
from raylib.doctor import FAIL, NOTE, OK, WARN

pytestmark = pytest.mark.unit


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when this returns: nothing listens there


@pytest.fixture
def http_server():
    """A real HTTP server on loopback; `routes` maps a path to (status, JSON body)."""
    routes: dict[str, tuple[int, dict]] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            status, body = routes.get(self.path.split("?")[0], (403, {"error": "AccessDenied"}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", routes
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL",
                "AWS_ENDPOINT_URL_S3", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))


# -- versions ------------------------------------------------------------------------------------


def test_versions_on_this_machine_are_the_pinned_ones():
    c = doctor.check_versions()
    assert c.status == OK, c
    assert "ray 2.60.0" in c.detail and "deepspeed 0.19.8" in c.detail and "torch 2.13.0" in c.detail


def test_versions_mismatch_warns_and_missing_fails():
    have = {"ray": "2.59.0", "torch": "2.13.0", "deepspeed": "0.19.8"}
    c = doctor.check_versions(version=lambda d: have[d])
    assert c.status == WARN and "ray 2.59.0 (pinned 2.60.0)" in c.detail and "pip install" in c.fix

    def missing(dist: str) -> str:
        if dist == "deepspeed":
            raise metadata.PackageNotFoundError(dist)
        return doctor.PINNED[dist]

    c = doctor.check_versions(version=missing)
    assert c.status == FAIL and "deepspeed not installed" in c.detail and "pip install" in c.fix


# -- tier directories ----------------------------------------------------------------------------


def test_tier_dir_with_room_is_ok(tmp_path):
    c = doctor.check_tier_dir(tmp_path, min_free_gb=0.001)
    assert c.status == OK and "GB free" in c.detail


def test_tier_dir_below_the_threshold_fails_with_the_fix(tmp_path):
    c = doctor.check_tier_dir(tmp_path, min_free_gb=1e9)  # a billion GB: no disk has that
    assert c.status == FAIL and "below the 1e+09 GB" in c.detail
    assert "free space" in c.fix


def test_tier_dir_missing_or_not_a_dir_or_unwritable_fails(tmp_path):
    c = doctor.check_tier_dir(tmp_path / "nope")
    assert c.status == FAIL and c.fix.startswith("mkdir -p")
    f = tmp_path / "file"
    f.write_text("x")
    assert doctor.check_tier_dir(f).status == FAIL
    c = doctor.check_tier_dir("/proc")  # a directory no file can be created in, even as root
    assert c.status == FAIL and "not writable" in c.detail


# -- S3 ------------------------------------------------------------------------------------------


def test_s3_credentials_missing_warns_with_the_fix():
    c = doctor.check_s3_credentials()
    assert c.status == WARN
    assert "AWS_ACCESS_KEY_ID" in c.fix and "raylib submit --env" in c.fix


def test_s3_credentials_present_or_half_present(monkeypatch, tmp_path):
    secret = "wJalrXUtnFEMI-not-printed"
    c = doctor.check_s3_credentials({"AWS_ACCESS_KEY_ID": "AKIA1", "AWS_SECRET_ACCESS_KEY": secret})
    assert c.status == OK and secret not in str(c)
    c = doctor.check_s3_credentials({"AWS_SECRET_ACCESS_KEY": secret})
    assert c.status == FAIL and "AWS_ACCESS_KEY_ID is not" in c.detail and secret not in str(c)
    creds = tmp_path / "credentials"
    creds.write_text("[default]\naws_access_key_id = AKIA1\naws_secret_access_key = x\n")
    c = doctor.check_s3_credentials({"AWS_SHARED_CREDENTIALS_FILE": str(creds)})
    assert c.status == OK and "profile 'default'" in c.detail


def test_s3_endpoint_unreachable_fails_with_the_fix():
    endpoint = f"http://127.0.0.1:{closed_port()}"
    c = doctor.check_s3_endpoint(endpoint, timeout_s=3)
    assert c.status == FAIL and endpoint in c.detail
    assert "AWS_ENDPOINT_URL" in c.fix


def test_s3_endpoint_reachable_is_ok_even_when_it_denies(http_server):
    url, _ = http_server  # answers 403 AccessDenied, as S3 does to an anonymous GET
    c = doctor.check_s3_endpoint(url)
    assert c.status == OK and "HTTP 403" in c.detail
    assert doctor.check_s3_endpoint(None).status == NOTE


# -- GPUs ----------------------------------------------------------------------------------------


def test_no_gpu_on_this_machine_is_a_note_not_a_failure():
    c = doctor.check_gpus()  # the real pynvml: no NVIDIA driver here
    assert c.status == NOTE and "gloo" in c.detail


def fake_nvml(temps=(40, 41)):
    """A stand-in for pynvml: this machine has no GPU, so NVML cannot report one for real."""
    handles = list(range(len(temps)))
    return SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(handles),
        nvmlSystemGetDriverVersion=lambda: b"560.35.03",
        nvmlDeviceGetHandleByIndex=lambda i: handles[i],
        nvmlDeviceGetName=lambda h: "NVIDIA H100 80GB HBM3",
        nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(total=80 * 2**30),
        nvmlDeviceGetTemperature=lambda h, sensor: temps[h],
        NVML_TEMPERATURE_GPU=0,
    )


def test_gpus_seen_by_nvml_but_not_by_torch_warn():
    c = doctor.check_gpus(fake_nvml(), torch_cuda=lambda: False)
    assert c.status == WARN and "2 GPU(s), driver 560.35.03" in c.detail
    assert "CUDA build of torch" in c.fix


def test_gpus_usable_are_ok_and_hot_ones_warn():
    c = doctor.check_gpus(fake_nvml(), torch_cuda=lambda: True)
    assert c.status == OK and "NVIDIA H100 80GB HBM3 80 GiB" in c.detail
    c = doctor.check_gpus(fake_nvml(temps=(40, 91)), torch_cuda=lambda: True)
    assert c.status == WARN and "GPU 1 at 91 C" in c.detail


def test_pynvml_missing_warns(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    c = doctor.check_gpus()
    assert c.status == WARN and "nvidia-ml-py" in c.fix


# -- topology labels -----------------------------------------------------------------------------


def node(gpus: int, **labels: str) -> dict:
    return {"node_id": "ab" * 28, "state": "ALIVE", "resources_total": {"CPU": 8, "GPU": gpus},
            "labels": {"ray.io/node-id": "ab" * 28, **labels}}


def test_topology_labels():
    assert doctor.check_topology_labels([node(0)]).status == NOTE
    assert doctor.check_topology_labels([node(8, leaf="tor0", spine="s0")]).status == OK
    assert doctor.check_topology_labels([node(8, rack="r1", spine="s0")]).status == OK
    c = doctor.check_topology_labels([node(8)])
    assert c.status == WARN and "no leaf/spine label" in c.detail and "ray start --labels" in c.fix
    c = doctor.check_topology_labels([node(8, leaf="t", spine="s", **{"nvlink-island-size": "3"})])
    assert c.status == WARN and "does not divide its 8 GPUs" in c.detail


# -- the Ray cluster (HTTP only here) ------------------------------------------------------------


def test_ray_without_an_address_is_a_note():
    c, conn = doctor.check_ray(None)
    assert c.status == NOTE and conn is None


def test_ray_unreachable_fails_with_the_fix():
    c, conn = doctor.check_ray(f"http://127.0.0.1:{closed_port()}", timeout_s=3)
    assert c.status == FAIL and conn is None and "--address" in c.fix


def test_ray_that_wants_a_token_we_lack_fails(http_server, monkeypatch, tmp_path):
    url, routes = http_server
    routes["/api/version"] = (401, {"error": "Unauthorized"})
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "missing-token"))
    c, _ = doctor.check_ray(url)
    assert c.status == FAIL and "requires a Ray auth token" in c.detail
    assert "RAY_AUTH_TOKEN_PATH" in c.fix


def test_ray_version_mismatch_warns(http_server):
    url, routes = http_server
    routes["/api/version"] = (200, {"ray_version": "2.59.0"})
    c, conn = doctor.check_ray(url)
    assert c.status == WARN and "Ray 2.59.0" in c.detail and conn["url"] == url


# -- the command ---------------------------------------------------------------------------------


def test_doctor_command_exit_codes(tmp_path, capsys):
    assert cli.main(["doctor", "--tier-dir", str(tmp_path), "--min-free-gb", "0.001"]) == 0
    out = capsys.readouterr().out
    assert "OK    versions" in out and "NOTE  gpus" in out and "WARN  s3-credentials" in out
    assert cli.main(["doctor", "--tier-dir", str(tmp_path), "--min-free-gb", "1e9"]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  tier {tmp_path}" in out and "fix: free space" in out
