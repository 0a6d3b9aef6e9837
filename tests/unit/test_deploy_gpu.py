"""The GPU node specs in deploy/kubernetes: what CUDA IPC between the engine's and the sidecar's
containers needs (docs/gpu.md, "Deployment"), and nothing more privileged."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.support.processes import REPO

SPECS = ["gpu-pod.yaml", "gpu-pod-dra.yaml"]


def _pod(name: str) -> dict[str, Any]:
    documents = list(yaml.safe_load_all((REPO / "deploy" / "kubernetes" / name).read_text()))
    pods = [document for document in documents if document["kind"] == "Pod"]
    assert len(pods) == 1
    return pods[0]


@pytest.mark.parametrize("name", SPECS)
def test_a_gpu_pod_shares_one_pid_namespace_and_nothing_of_the_host(name: str) -> None:
    spec = _pod(name)["spec"]
    assert spec["shareProcessNamespace"] is True  # CUDA IPC: the exporter visible to the importer
    for key in ("hostPID", "hostIPC", "hostNetwork"):
        assert not spec.get(key), key
    for container in spec["containers"]:
        context = container.get("securityContext", {})
        assert not context.get("privileged")
        assert "SYS_PTRACE" not in context.get("capabilities", {}).get("add", [])
        mounts = {mount["mountPath"] for mount in container["volumeMounts"]}
        assert {"/dev/shm", "/run/kvsidecar"} <= mounts


@pytest.mark.parametrize("name", SPECS)
def test_the_sidecar_sees_the_engines_gpu_without_claiming_another(name: str) -> None:
    spec = _pod(name)["spec"]
    containers = {container["name"]: container for container in spec["containers"]}
    engine, sidecar = containers["vllm"], containers["kvsidecar"]
    assert "nvidia.com/gpu" not in sidecar["resources"].get("limits", {})
    env = {item["name"]: item.get("value") for item in sidecar.get("env", [])}
    engine_claims = {claim["name"] for claim in engine["resources"].get("claims", [])}
    sidecar_claims = {claim["name"] for claim in sidecar["resources"].get("claims", [])}
    if engine_claims:  # DRA: the same claim, one GPU
        assert sidecar_claims == engine_claims
        assert {claim["name"] for claim in spec["resourceClaims"]} == engine_claims
    else:  # device plugin: the engine claims it, the sidecar is shown it by the NVIDIA runtime
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
        assert "utility" in env["NVIDIA_DRIVER_CAPABILITIES"] and "compute" in env["NVIDIA_DRIVER_CAPABILITIES"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert sidecar[probe]["grpc"]["port"] == 50151
