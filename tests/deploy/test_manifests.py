"""Every deploy/ manifest parses and validates, and every deploy/ shell script passes `bash -n` and shellcheck.

Kubernetes core objects are checked against the Kubernetes schema (kubernetes-validate, strict: unknown
fields fail); the KubeRay objects against deploy/kuberay/crd_schema_subset.yaml (jsonschema), and the pod
templates inside them against the core schema as v1 PodTemplates.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.conftest import DEPLOY, tool

K8S_VERSION = "1.30.0"
MANIFESTS = sorted(p for p in (DEPLOY / "kuberay").glob("*.yaml") if p.name != "crd_schema_subset.yaml")
SCRIPTS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".sh", ".sbatch"))
CRD_KINDS = ("RayCluster", "RayJob")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def pod_templates(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj["spec"].get("rayClusterSpec", obj["spec"])
    return [spec["headGroupSpec"]["template"]] + [g["template"] for g in spec.get("workerGroupSpecs", [])]


def validate_core(obj: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def validate_crd(obj: dict[str, Any]) -> None:
    import jsonschema

    schema = yaml.safe_load((DEPLOY / "kuberay" / "crd_schema_subset.yaml").read_text())
    jsonschema.validate(obj, {**schema[obj["kind"]], "definitions": schema["definitions"]})


@pytest.mark.timeout(60)
def test_the_kuberay_folder_has_every_object_the_run_needs():
    kinds = sorted(d["kind"] for p in MANIFESTS for d in documents(p))
    assert kinds == sorted(["PersistentVolumeClaim", "Secret", "Deployment", "Service", "Service", "RayCluster", "RayJob", "RayJob"])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_manifest_validates(path: Path):
    docs = documents(path)
    assert docs, f"{path} holds no object"
    for obj in docs:
        if obj["kind"] in CRD_KINDS:
            validate_crd(obj)
            for tpl in pod_templates(obj):
                validate_core({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": tpl})
                env = {e["name"]: e for c in tpl["spec"]["containers"] for e in c.get("env", [])}
                assert env["ASYNCRL_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "asyncrl-secret"
                claims = {v["persistentVolumeClaim"]["claimName"] for v in tpl["spec"]["volumes"] if "persistentVolumeClaim" in v}
                assert claims == {"asyncrl-shared"}
        else:
            validate_core(obj)


@pytest.mark.timeout(60)
def test_validators_reject_a_broken_manifest():
    """The checks above can fail: a misspelt RayJob key, a worker group without a name, a bad core field."""
    import jsonschema
    import kubernetes_validate

    job = documents(DEPLOY / "kuberay" / "rayjob.yaml")[0]
    with pytest.raises(jsonschema.ValidationError):
        validate_crd({**job, "spec": {**job["spec"], "entrypoin": "asyncrl train"}})
    cluster = documents(DEPLOY / "kuberay" / "raycluster.yaml")[0]
    group = {k: v for k, v in cluster["spec"]["workerGroupSpecs"][0].items() if k != "groupName"}
    with pytest.raises(jsonschema.ValidationError):
        validate_crd({**cluster, "spec": {**cluster["spec"], "workerGroupSpecs": [group]}})
    svc = documents(DEPLOY / "kuberay" / "redis.yaml")[1]
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_core({**svc, "spec": {**svc["spec"], "ports": [{"port": "not-a-port"}]}})


@pytest.mark.timeout(60)
def test_the_rayjob_entrypoint_is_a_valid_asyncrl_config(tmp_path):
    from asyncrl.config import load

    argv = documents(DEPLOY / "kuberay" / "rayjob.yaml")[0]["spec"]["entrypoint"].split()
    assert argv[:2] == ["asyncrl", "train"]
    # the model folder exists in the pod only: the same keys, a folder of this machine
    overrides = [f"model.path={tmp_path}" if a.startswith("model.path=") else a for a in argv[3:]]
    cfg = load(DEPLOY.parent / argv[2], overrides)
    assert cfg.ray.enabled and cfg.ray.address == "auto" and cfg.queue.metadata == "redis"
    assert cfg.queue.redis_url == "redis://asyncrl-redis:6379/0" and cfg.logging.run_root == "/workspace/runs"


@pytest.mark.timeout(60)
def test_the_elastic_rayjob_follows_its_autoscaled_rollout_group(tmp_path):
    """rayjob-elastic.yaml: the autoscaler may resize the rollout group, whose nodes offer the resource the
    run follows (`rollout.follow_cluster`), as many of it per node as GPUs, one per server."""
    import json
    import shlex

    import jsonschema

    from asyncrl.config import load

    job = documents(DEPLOY / "kuberay" / "rayjob-elastic.yaml")[0]
    spec = job["spec"]["rayClusterSpec"]
    assert spec["enableInTreeAutoscaling"] is True
    with pytest.raises(jsonschema.ValidationError):  # the autoscaler's options are checked, not any object
        validate_crd({**job, "spec": {**job["spec"], "rayClusterSpec": {**spec, "autoscalerOptions": {"upscalingmode": "Default"}}}})
    argv = job["spec"]["entrypoint"].split()
    overrides = [f"model.path={tmp_path}" if a.startswith("model.path=") else a for a in argv[3:]]
    cfg = load(DEPLOY.parent / argv[2], overrides)
    key = cfg.rollout.follow_cluster
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    rollout = groups["rollout"]
    assert rollout["minReplicas"] < rollout["maxReplicas"]  # it scales
    offered = json.loads(shlex.split(rollout["rayStartParams"]["resources"])[0])  # as `ray start --resources` reads it
    gpus = int(rollout["rayStartParams"]["num-gpus"])
    assert offered == {key: gpus} and cfg.rollout.ray_resources[key] == 1 and cfg.rollout.gpus_per_worker == 1
    assert cfg.rollout.num_servers == gpus * rollout["replicas"]
    trainer = json.loads(shlex.split(groups["trainer"]["rayStartParams"]["resources"])[0])
    assert set(trainer) == set(cfg.trainer.ray_resources) and groups["trainer"]["minReplicas"] == groups["trainer"]["maxReplicas"]


@pytest.mark.timeout(60)
def test_there_are_scripts():
    names = {p.name for p in SCRIPTS}
    assert {"start_cluster.sh", "asyncrl.sbatch"} <= names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_shell_script_passes_bash_n_and_shellcheck(path: Path):
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    done = subprocess.run([tool("shellcheck"), "--shell=bash", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout
