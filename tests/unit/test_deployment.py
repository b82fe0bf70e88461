"""deployment/: cluster launcher YAMLs and KubeRay manifests, checked with Ray's own code.

- every cluster YAML validates against ray/autoscaler/ray-schema.json and passes Ray's
  prepare_config + validate_config (the checks `ray up` makes before launching anything);
- the KubeRay manifests go through Ray's own KubeRay -> autoscaler conversion, whose output must
  validate too, with the GPU groups' resources and labels;
- the shell that computes topology labels on a worker actually runs, with stand-ins for the
  EC2 metadata service, the AWS CLI, `hostname` and `ray` on PATH, and its --labels string is
  parsed by Ray's parser;
- security: no public ingress rule, the dashboard bound to loopback (VMs) or a ClusterIP
  service (Kubernetes), token auth on, Ray's default security group (SSH from 0.0.0.0/0) never
  created.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import stat
import subprocess
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.unit.conftest import REPO

pytestmark = pytest.mark.unit

DEPLOYMENT = REPO / "deployment"
CLUSTER_YAMLS = sorted(DEPLOYMENT.glob("*.yaml"))  # top level only: topologies/ holds other files
KUBERAY = sorted((DEPLOYMENT / "kuberay").glob("*.yaml"))
TOPOLOGY_LABELS = {"leaf", "spine", "nvlink-island-size", "raylib.io/node-type"}
"""Labels raylib's placement reads (leaf/spine/nvlink-island-size) and the node-type label gangs
select, which the autoscaler knows before a node exists."""


def ray_schema() -> dict:
    import ray.autoscaler

    return json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_expected_files_are_there():
    assert {"aws-gpu.yaml", "local-onprem.yaml", "fake-multinode.yaml"} <= {p.name for p in CLUSTER_YAMLS}
    assert {"raycluster.yaml", "rayjob.yaml"} <= {p.name for p in KUBERAY}


# -- cluster launcher YAMLs ----------------------------------------------------------------------


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_yaml_validates_against_rays_schema(path):
    jsonschema.validate(load(path), ray_schema())


@pytest.mark.parametrize("path", CLUSTER_YAMLS, ids=lambda p: p.name)
def test_cluster_yaml_passes_ray_up_checks(path):
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(load(path))  # fills in the provider's defaults, as `ray up` does
    validate_config(config)
    assert config["head_node_type"] in config["available_node_types"]


@pytest.mark.parametrize("path", [p for p in CLUSTER_YAMLS if "available_node_types" in load(p)],
                         ids=lambda p: p.name)  # the local provider's hosts are fixed: no types
def test_gpu_node_types_carry_topology_labels_and_limits(path):
    from ray._private.label_utils import validate_node_label_syntax

    config = load(path)
    gpu_types = {name: t for name, t in config.get("available_node_types", {}).items()
                 if t["resources"].get("GPU", 0) > 0}
    assert gpu_types, "a GPU node type"
    for name, node_type in gpu_types.items():
        labels = node_type.get("labels", {})
        validate_node_label_syntax(labels)
        assert {"raylib.io/node-type", "nvlink-island-size"} <= set(labels), name
        assert labels["raylib.io/node-type"] == name
        island = int(labels["nvlink-island-size"])
        assert node_type["resources"]["GPU"] % island == 0, "islands split the node's GPUs"
        assert 0 <= node_type["min_workers"] <= node_type["max_workers"], name


@pytest.mark.parametrize("path", [p for p in CLUSTER_YAMLS if load(p)["provider"]["type"] != "external"],
                         ids=lambda p: p.name)
def test_real_clusters_are_private_and_authenticated(path):
    config = load(path)
    assert "0.0.0.0" not in json.dumps(config), "nothing bound or opened to every address"
    for rule in config["provider"].get("security_group", {}).get("IpPermissions", []):
        assert all(r["CidrIp"] != "0.0.0.0/0" for r in rule.get("IpRanges", []))
    head = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head, "dashboard on the head's loopback only"
    assert "RAY_AUTH_MODE=token" in head
    assert "RAY_AUTH_MODE=token" in " ".join(config["worker_start_ray_commands"])
    assert config["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"
    setup = " ".join(config["setup_commands"])
    assert "pip install" in setup and "-e ~/raylib" in setup, "raylib installed on every node"
    assert config["file_mounts"].get("~/raylib") == "."
    if config["provider"]["type"] == "aws":
        assert config["provider"]["use_internal_ips"] is True
        for name, node_type in config["available_node_types"].items():
            # With SecurityGroupIds on every node type Ray creates no group of its own (its
            # default one opens SSH to 0.0.0.0/0: ray/autoscaler/_private/aws/config.py).
            assert node_type["node_config"].get("SecurityGroupIds"), name
            assert node_type["node_config"].get("SubnetIds"), name


def test_fake_multinode_variant_matches_the_aws_shape():
    fake, aws = load(DEPLOYMENT / "fake-multinode.yaml"), load(DEPLOYMENT / "aws-gpu.yaml")
    assert fake["provider"]["module"].endswith("fake_multi_node.node_provider.FakeMultiNodeProvider")
    assert fake["provider"]["gcs_address"] and fake["provider"]["head_node_id"]
    gpu = fake["available_node_types"]["gpu-sim"]["labels"]
    assert TOPOLOGY_LABELS <= set(gpu)
    aws_static = set(aws["available_node_types"]["gpu-a100"]["labels"])
    assert aws_static <= set(gpu), "the same static labels as the real GPU type"


# -- the worker start commands, run for real with stand-ins ---------------------------------------


def _fake_bin(tmp_path: Path, scripts: dict[str, str]) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in scripts.items():
        p = bin_dir / name
        p.write_text("#!/bin/bash\n" + body)
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return bin_dir


FAKE_RAY = """
if [ "$1" = start ]; then
  python3 -c 'import json, os, sys
json.dump({"args": sys.argv[1:], "auth": os.environ.get("RAY_AUTH_MODE")},
          open(os.environ["FAKE_RAY_OUT"], "w"))' "$@"
fi
"""
FAKE_CURL = """
url="${@: -1}"
case "$*" in *"-X PUT"*) echo -n imds-token; exit 0 ;; esac
case "$url" in
  */instance-id) echo -n i-0abc123 ;;
  */placement/availability-zone) echo -n us-west-2a ;;
  */placement/region) echo -n us-west-2 ;;
  *) exit 22 ;;
esac
"""


def _run_start_commands(config: dict, bin_dir: Path, tmp_path: Path) -> dict:
    out = tmp_path / "ray-start.json"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "RAY_HEAD_IP": "10.0.0.10", "FAKE_RAY_OUT": str(out)}
    for command in config["worker_start_ray_commands"]:
        subprocess.run(["bash", "-c", command], env=env, check=True, timeout=30)
    return json.loads(out.read_text())


def _labels(call: dict) -> dict[str, str]:
    from ray._private.label_utils import parse_node_labels_string

    (value,) = [a.split("=", 1)[1] for a in call["args"] if a.startswith("--labels=")]
    return parse_node_labels_string(value)  # Ray's own parser and syntax check


@pytest.mark.parametrize("topology, expected", [
    ("echo -e 'nn-spine1\\tnn-agg2\\tnn-leaf3'", {"spine": "nn-agg2", "leaf": "nn-leaf3"}),
    ("exit 254", {"spine": "us-west-2a", "leaf": "us-west-2a"}),  # no topology data: the AZ
])
def test_aws_worker_labels_come_from_instance_metadata(tmp_path, topology, expected):
    config = load(DEPLOYMENT / "aws-gpu.yaml")
    bin_dir = _fake_bin(tmp_path, {"ray": FAKE_RAY, "curl": FAKE_CURL, "aws": topology + "\n"})
    call = _run_start_commands(config, bin_dir, tmp_path)
    assert call["auth"] == "token"
    assert "--address=10.0.0.10:6379" in call["args"]
    assert _labels(call) == {"raylib.io/node": "i-0abc123", **expected}


@pytest.mark.parametrize("host, leaf", [("gpu-01", "tor0"), ("gpu-05", "tor1"), ("login-1", "default")])
def test_onprem_worker_labels_come_from_the_host_name(tmp_path, host, leaf):
    config = load(DEPLOYMENT / "local-onprem.yaml")
    bin_dir = _fake_bin(tmp_path, {"ray": FAKE_RAY, "hostname": f"echo {host}\n"})
    call = _run_start_commands(config, bin_dir, tmp_path)
    assert call["auth"] == "token"
    labels = _labels(call)
    assert labels["raylib.io/node"] == host and labels["leaf"] == leaf
    assert {"spine", "nvlink-island-size"} <= set(labels)


# -- KubeRay -------------------------------------------------------------------------------------


def kuberay_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def ray_cluster_crs() -> list[tuple[str, dict]]:
    """(file, a RayCluster CR): raycluster.yaml's, and the cluster a RayJob creates."""
    crs = []
    for path in KUBERAY:
        for doc in kuberay_docs(path):
            if doc["kind"] == "RayCluster":
                crs.append((path.name, doc))
            elif doc["kind"] == "RayJob":
                crs.append((path.name, {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                                        "metadata": dict(doc["metadata"]),
                                        "spec": doc["spec"]["rayClusterSpec"]}))
    return crs


@pytest.mark.parametrize("path", KUBERAY, ids=lambda p: p.name)
def test_kuberay_manifests_have_the_fields_kuberay_needs(path):
    import ray

    docs = kuberay_docs(path)
    ray_docs = [d for d in docs if d["apiVersion"] == "ray.io/v1"]
    assert len(ray_docs) == 1 and ray_docs[0]["kind"] in ("RayCluster", "RayJob")
    doc = ray_docs[0]
    assert doc["metadata"]["name"]
    spec = doc["spec"] if doc["kind"] == "RayCluster" else doc["spec"]["rayClusterSpec"]
    assert spec["rayVersion"] == ray.__version__, "the images' Ray must be the pinned one"
    head = spec["headGroupSpec"]
    assert isinstance(head["rayStartParams"], dict)
    assert head["template"]["spec"]["containers"][0]["image"]
    assert spec["workerGroupSpecs"]
    for group in spec["workerGroupSpecs"]:
        assert group["groupName"] and isinstance(group["rayStartParams"], dict)
        assert 0 <= group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        container = group["template"]["spec"]["containers"][0]
        assert container["image"] == head["template"]["spec"]["containers"][0]["image"]
        limits = container["resources"]["limits"]
        assert int(limits["nvidia.com/gpu"]) > 0 and limits["cpu"] and limits["memory"]
        assert {"raylib.io/node-type", "nvlink-island-size"} <= set(group["labels"])
    if doc["kind"] == "RayJob":
        assert doc["spec"]["entrypoint"].startswith("python -m raylib run jobs/configs/")
        assert doc["spec"]["shutdownAfterJobFinishes"] is True


@pytest.mark.parametrize("name, cr", ray_cluster_crs(), ids=lambda x: x if isinstance(x, str) else "")
def test_ray_derives_a_valid_autoscaling_config_from_the_cr(name, cr):
    """Ray's own KubeRay -> autoscaler conversion (what the autoscaler sidecar runs)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import (
        _derive_autoscaling_config_from_ray_cr,
    )

    cr = copy.deepcopy(cr)
    cr["metadata"].setdefault("namespace", "default")  # set by the API server in a live CR
    config = _derive_autoscaling_config_from_ray_cr(cr)
    jsonschema.validate(config, ray_schema())
    workers = {k: v for k, v in config["available_node_types"].items() if k != "headgroup"}
    assert workers and config["available_node_types"]["headgroup"]["resources"]["CPU"] == 0
    for group, node_type in workers.items():
        assert node_type["resources"]["GPU"] > 0, group
        labels = node_type["labels"]  # what a gang's label selector can make it scale
        assert labels["raylib.io/node-type"] and int(labels["nvlink-island-size"]) > 0, group
    leaf_groups = [t for t in workers.values() if "leaf" in t["labels"]]
    if name == "raycluster.yaml":
        assert leaf_groups and all("spine" in t["labels"] for t in leaf_groups)


@pytest.mark.parametrize("name, cr", ray_cluster_crs(), ids=lambda x: x if isinstance(x, str) else "")
def test_kuberay_clusters_are_private_and_authenticated(name, cr):
    spec = cr["spec"]
    assert spec["authOptions"]["mode"] == "token"
    assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    text = (DEPLOYMENT / "kuberay" / name).read_text()
    assert not re.search(r"\b(LoadBalancer|NodePort)\b", yaml.safe_dump(spec))
    assert "dashboard-host" not in yaml.safe_dump(spec["headGroupSpec"]["rayStartParams"])
    assert "enableInTreeAutoscaling: true" in text
    assert spec["autoscalerOptions"]["version"] == "v2", "label selectors need autoscaler v2"


def test_kuberay_network_policy_limits_ingress_to_the_cluster():
    docs = kuberay_docs(DEPLOYMENT / "kuberay" / "raycluster.yaml")
    (cluster,) = [d for d in docs if d["kind"] == "RayCluster"]
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    sources = policy["spec"]["ingress"][0]["from"]
    assert all("ipBlock" not in s for s in sources), "no address ranges, only pods/namespaces"


def test_yaml_entrypoints_in_manifests_exist():
    for path in KUBERAY:
        for doc in kuberay_docs(path):
            if doc["kind"] == "RayJob":
                args = shlex.split(doc["spec"]["entrypoint"])
                assert args[:4] == ["python", "-m", "raylib", "run"]  # the generic entrypoint
                assert (REPO / args[4]).is_file()  # its config, in the checkout
