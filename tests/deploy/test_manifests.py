"""Every deploy/ manifest parses and validates, and every deploy/ shell script passes `bash -n` and shellcheck.

Kubernetes core objects are checked against the Kubernetes schema (kubernetes-validate, strict: unknown
fields fail); the KubeRay objects against deploy/kuberay/crd_schema_subset.yaml (jsonschema), and the pod
templates inside them against the core schema as v1 PodTemplates.

Every launch file that spreads a run over several hosts (the sbatch file, the RayJobs) gives the keys such a run
needs whatever its recipe says, and the config it launches loads with them: listeners on each node's own
address (`weights.host=auto`, `queue.bind_host=auto`), planes that cross hosts, the queue in a Redis that asks
for a password. The sbatch file runs for real, with `srun`, `scontrol`, Redis and `start_cluster.sh` stood in for.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from tests.deploy.conftest import BIN, DEPLOY, tool

K8S_VERSION = "1.30.0"
MANIFESTS = sorted(p for p in (DEPLOY / "kuberay").glob("*.yaml") if p.name != "crd_schema_subset.yaml")
SCRIPTS = sorted(p for p in DEPLOY.rglob("*") if p.suffix in (".sh", ".sbatch"))
CRD_KINDS = ("RayCluster", "RayJob")
RAYJOBS = sorted((DEPLOY / "kuberay").glob("rayjob*.yaml"))
MULTINODE_KEYS = ("weights.host=auto", "queue.bind_host=auto")
"""What every launch file over several hosts states itself (a recipe that says otherwise must not win)."""


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
    assert kinds == sorted(["PersistentVolumeClaim", "Secret", "Deployment", "Service", "NetworkPolicy", "Deployment", "Service",
                            "RayCluster", "RayJob", "RayJob"])


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


def head_env(obj: dict[str, Any], secret: str) -> dict[str, str]:
    """The env of the head's first container as Kubernetes builds it: a Secret's key reads `secret`, and
    `$(VAR)` expands a variable defined above it."""
    env: dict[str, str] = {}
    for e in pod_templates(obj)[0]["spec"]["containers"][0].get("env", []):
        if "valueFrom" in e:
            assert "secretKeyRef" in e["valueFrom"], e
            env[e["name"]] = secret
        else:
            env[e["name"]] = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), e["value"])
    return env


def launched(argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> Any:
    """The config of `asyncrl train RECIPE key=value ...` as the driver loads it, in the environment `env`
    (the model folder exists only where the job runs: the same keys, a folder of this machine)."""
    from asyncrl.config import load

    assert argv[:2] == ["asyncrl", "train"], argv
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    overrides = [f"model.path={tmp_path}" if a.startswith("model.path=") else a for a in argv[3:]]
    recipe = Path(argv[2]) if Path(argv[2]).is_absolute() else DEPLOY.parent / argv[2]
    return load(recipe, overrides)


def assert_multinode(argv: list[str], cfg: Any) -> None:
    """A run over several hosts: the launch line states the host keys and planes that cross hosts (whatever the
    recipe), and the config it loads keeps them, with the queue in a Redis that asks for a password."""
    from checkpoint_engine.config import WeightsConfig
    from transfer_queue.config import TransferQueueConfig

    given = dict(a.split("=", 1) for a in argv[3:] if "=" in a)
    for kv in MULTINODE_KEYS:
        key, value = kv.split("=", 1)
        assert given.get(key) == value, f"{kv} missing from {argv}"
    assert TransferQueueConfig(storage=given["queue.storage"]).crosses_hosts, argv
    assert WeightsConfig(backend=given["weights.backend"], device=cfg.weights.device).crosses_hosts, argv
    assert cfg.weights.host == "auto" and cfg.queue.bind_host == "auto"
    assert cfg.queue.crosses_hosts and cfg.weights.crosses_hosts
    assert cfg.trainer.gpus_per_rank == 1 and cfg.rollout.gpus_per_worker == 1
    assert cfg.queue.metadata == "redis" and urlparse(cfg.queue.redis_url).password, cfg.queue.redis_url


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", RAYJOBS, ids=lambda p: p.name)
def test_a_rayjob_launches_a_run_over_several_hosts(path: Path, tmp_path, monkeypatch):
    """The entrypoint, split as the submitter's shell splits it (KubeRay runs it in `bash -c`; `ray job submit`
    quotes each word again for the head's shell), loads in the head's env: the Redis URL, its password from
    the Secret, comes from there and is on no command line."""
    job = documents(path)[0]
    entry = job["spec"]["entrypoint"]
    argv = shlex.split(entry)
    env = head_env(job, "0123abcd")
    cfg = launched(argv, tmp_path, monkeypatch, env)
    assert_multinode(argv, cfg)
    assert cfg.ray.enabled and cfg.ray.address == "auto" and cfg.logging.run_root == "/workspace/runs"
    assert cfg.queue.redis_url == "redis://:0123abcd@asyncrl-redis:6379/0" == env["ASYNCRL_REDIS_URL"]
    assert "0123abcd" not in entry and "redis://" not in entry


@pytest.mark.timeout(60)
def test_redis_asks_for_a_password_and_is_never_public():
    """redis.yaml: requirepass from the Secret the RayJobs read; no Service of the folder is a LoadBalancer or a
    NodePort (a Redis login opens every run's queue: port-forward from outside)."""
    redis = documents(DEPLOY / "kuberay" / "redis.yaml")
    container = redis[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert container["args"][:2] == ["--requirepass", "$(REDIS_PASSWORD)"]
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "asyncrl-redis", "key": "password"}
    services = [d for p in MANIFESTS for d in documents(p) if d["kind"] == "Service"]
    assert services and all(s["spec"].get("type", "ClusterIP") == "ClusterIP" for s in services), services
    for obj in (d for p in MANIFESTS for d in documents(p) if d["kind"] in CRD_KINDS):
        env = head_env(obj, "0123abcd")
        assert env["ASYNCRL_REDIS_URL"] == "redis://:0123abcd@asyncrl-redis:6379/0", obj["metadata"]["name"]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector of only `matchLabels` selects a pod with `labels`."""
    assert set(selector) == {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def pods() -> dict[str, dict[str, str]]:
    """Every pod template of the folder: `<object name>/<n>` -> its labels."""
    out = {}
    for obj in (d for p in MANIFESTS for d in documents(p)):
        if obj["kind"] in CRD_KINDS:
            tpls = pod_templates(obj)
        elif obj["kind"] == "Deployment":
            tpls = [obj["spec"]["template"]]
        else:
            continue
        for i, tpl in enumerate(tpls):
            out[f"{obj['metadata']['name']}/{i}"] = tpl["metadata"]["labels"]
    return out


@pytest.mark.timeout(60)
def test_only_the_runs_ray_pods_and_the_status_pod_may_reach_redis():
    """redis.yaml's NetworkPolicy selects the Redis pod and admits, on its port only, the Ray pods of every
    RayCluster / RayJob and the status pod, by their labels: no namespace, address block or other pod."""
    redis = documents(DEPLOY / "kuberay" / "redis.yaml")
    policies = [d for p in MANIFESTS for d in documents(p) if d["kind"] == "NetworkPolicy"]
    assert len(policies) == 1, policies
    spec = policies[0]["spec"]
    everyone = pods()
    assert {name for name, labels in everyone.items() if selects(spec["podSelector"], labels)} == {"asyncrl-redis/0"}
    assert selects(spec["podSelector"], redis[0]["spec"]["template"]["metadata"]["labels"])
    assert spec["policyTypes"] == ["Ingress"] and len(spec["ingress"]) == 1
    rule = spec["ingress"][0]
    assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
    assert redis[0]["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] == 6379
    assert all(set(peer) == {"podSelector"} for peer in rule["from"]), rule  # same namespace, by label only
    admitted = {name for name, labels in everyone.items() if any(selects(peer["podSelector"], labels) for peer in rule["from"])}
    ray = {name for name in everyone if name.split("/")[0] in {d["metadata"]["name"] for p in MANIFESTS for d in documents(p)
                                                                  if d["kind"] in CRD_KINDS}}
    assert ray and admitted == ray | {"asyncrl-status/0"}, admitted


@pytest.mark.timeout(60)
def test_the_status_service_serves_the_status_view_not_redis(monkeypatch):
    """status-service.yaml: a Deployment running `asyncrl status --redis env --watch --prometheus PORT` bound to its
    pod's address, its Redis URL from the Secret, and a ClusterIP Service for PORT: nothing of it is Redis's port."""
    from asyncrl.observe.command import parse

    deployment, service = documents(DEPLOY / "kuberay" / "status-service.yaml")
    assert (deployment["kind"], service["kind"]) == ("Deployment", "Service")
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "asyncrl-redis", "key": "password"}
    assert env["ASYNCRL_REDIS_URL"]["value"] == "redis://:$(REDIS_PASSWORD)@asyncrl-redis:6379/0"
    argv = [a.replace("$(POD_IP)", "10.1.2.3") for a in container["args"]]  # as Kubernetes expands it
    assert "command" not in container and argv[0] == "status"  # the image's entrypoint is `asyncrl`
    monkeypatch.setenv("ASYNCRL_REDIS_URL", "redis://:0123abcd@asyncrl-redis:6379/0")
    args = parse(argv[1:])
    assert args.redis == "env" and args.watch and args.prometheus_host == "10.1.2.3"
    ports = container["ports"]
    assert [p["containerPort"] for p in ports] == [args.prometheus] and args.prometheus != 6379
    assert service["spec"].get("type", "ClusterIP") == "ClusterIP"
    assert selects({"matchLabels": service["spec"]["selector"]}, pod["metadata"]["labels"])
    assert selects(deployment["spec"]["selector"], pod["metadata"]["labels"])
    named = {p["name"]: p["containerPort"] for p in ports}
    for p in service["spec"]["ports"]:
        assert p["port"] != 6379 and named.get(p["targetPort"], p["targetPort"]) == args.prometheus, p
    redis = documents(DEPLOY / "kuberay" / "redis.yaml")[0]["spec"]["template"]["metadata"]["labels"]
    assert not selects({"matchLabels": service["spec"]["selector"]}, redis)  # it fronts no Redis pod


@pytest.mark.timeout(60)
def test_the_elastic_rayjob_follows_its_autoscaled_rollout_group(tmp_path, monkeypatch):
    """rayjob-elastic.yaml: the autoscaler may resize the rollout group, whose nodes offer the resource the
    run follows (`rollout.follow_cluster`), as many of it per node as GPUs, one per server."""
    import jsonschema

    job = documents(DEPLOY / "kuberay" / "rayjob-elastic.yaml")[0]
    spec = job["spec"]["rayClusterSpec"]
    assert spec["enableInTreeAutoscaling"] is True
    with pytest.raises(jsonschema.ValidationError):  # the autoscaler's options are checked, not any object
        validate_crd({**job, "spec": {**job["spec"], "rayClusterSpec": {**spec, "autoscalerOptions": {"upscalingmode": "Default"}}}})
    cfg = launched(shlex.split(job["spec"]["entrypoint"]), tmp_path, monkeypatch, head_env(job, "0123abcd"))
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


FAKE_SLURM = {
    "scontrol": 'printf "node-a\nnode-b\n"',
    # `srun ... hostname --ip-address` answers the head's address; a Ray node step is recorded (with the Redis URL
    # it would pass on to every node) and ends
    "srun": 'case " $* " in *" hostname "*) echo "10.9.0.1 fe80::1";; '
            '*) echo "$* url=${ASYNCRL_REDIS_URL:-}" >> "$FAKE/srun.args";; esac',
    # the config on stdin, the arguments apart: where the password went; then it serves until killed
    "redis-server": 'cat > "$FAKE/redis.conf"; echo "$*" > "$FAKE/redis.args"; exec sleep 60',
    "redis-cli": '[ -n "${REDISCLI_AUTH:-}" ] || exit 1; echo "$*" >> "$FAKE/redis-cli.args"; echo PONG',
}
FAKE_START = """#!/usr/bin/env bash
echo "$*" >> "$FAKE/start.args"
if [ "$1" = run ]; then
  while [ "$1" != -- ]; do shift; done; shift
  "$PYTHON" -c 'import json, os, sys; print(json.dumps({"argv": sys.argv[1:], "redis_url": os.environ.get("ASYNCRL_REDIS_URL", "")}))' "$@" > "$FAKE/run.json"
fi
"""


def run_sbatch(tmp_path: Path, *args: str, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    """deploy/slurm/asyncrl.sbatch run as Slurm would on a 2-node allocation, every outside tool a stand-in;
    what the driver was started with (`argv`, `redis_url` from its env) and what each stand-in saw."""
    fake, bin_dir, repo, submit = tmp_path / "fake", tmp_path / "bin", tmp_path / "repo", tmp_path / "submit"
    for d in (fake, bin_dir, repo / "deploy" / "ray", submit):
        d.mkdir(parents=True)
    for name, body in FAKE_SLURM.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (repo / "deploy" / "ray" / "start_cluster.sh").write_text(FAKE_START)
    (repo / "deploy" / "ray" / "start_cluster.sh").chmod(0o755)
    (repo / "configs").symlink_to(DEPLOY.parent / "configs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ASYNCRL_", "RAY_", "REDIS"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", FAKE=str(fake), PYTHON=str(BIN / "python"), ASYNCRL_SECRET="s",
               ASYNCRL_REPO=str(repo), SLURM_SUBMIT_DIR=str(submit), SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_ID="42",
               SLURM_GPUS_ON_NODE="8", SLURM_CPUS_PER_TASK="64", **(extra_env or {}))
    done = subprocess.run(["bash", str(DEPLOY / "slurm" / "asyncrl.sbatch"), *args], cwd=submit, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    out = json.loads((fake / "run.json").read_text())
    out["repo"], out["submit"], out["stdout"] = repo, submit, done.stdout
    out["seen"] = {f.name: f.read_text() for f in fake.iterdir() if f.name != "run.json"}
    return out


@pytest.mark.timeout(120)
def test_the_sbatch_file_launches_a_run_over_several_hosts(tmp_path, monkeypatch):
    """The default recipe over two nodes: the host keys and planes that cross hosts on the driver's line, Redis
    started on the head node bound to its address, a password of the job's own in its config (stdin) and in the
    driver's env, on no command line; its data kept per run name for a resume."""
    job = run_sbatch(tmp_path, "logging.run_name=gsm8k-a", "model.path=/models/q", "data.train_path=/data/train.jsonl")
    argv = job["argv"]
    assert argv[2] == str(job["repo"] / "configs" / "gsm8k_qwen2.5_0.5b_multinode.yaml")
    cfg = launched(argv, tmp_path, monkeypatch, {"ASYNCRL_REDIS_URL": job["redis_url"]})
    assert_multinode(argv, cfg)
    url = urlparse(cfg.queue.redis_url)
    assert (url.hostname, url.port) == ("10.9.0.1", 6380) and re.fullmatch(r"[0-9a-f]{32}", url.password or "")
    conf = job["seen"]["redis.conf"].splitlines()
    assert "bind 10.9.0.1" in conf and f"requirepass {url.password}" in conf and "port 6380" in conf
    assert f'dir "{job["submit"]}/redis/gsm8k-a"' in conf and "appendonly yes" in conf
    lines = " ".join(v for k, v in job["seen"].items() if k != "redis.conf") + " " + " ".join(argv) + job["stdout"]
    assert url.password not in lines
    assert "head --ip 10.9.0.1 --port 6379" in job["seen"]["srun.args"] and "worker --address 10.9.0.1:6379" in job["seen"]["srun.args"]


@pytest.mark.timeout(120)
def test_the_sbatch_file_makes_any_recipe_multinode_and_the_command_line_wins(tmp_path, monkeypatch):
    """The one-GPU recipe (CUDA IPC, half a GPU each) becomes a run over several hosts; a key given on the
    command line comes after the sbatch file's and wins (here nixl for the data plane); an exported
    ASYNCRL_REDIS_URL is used as it is (no redis-server started)."""
    external = "redis://:feed@10.9.0.7:6379/0"
    job = run_sbatch(tmp_path, "configs/gsm8k_qwen2.5_0.5b.yaml", "model.path=/models/q", "data.train_path=/data/train.jsonl",
                     "queue.storage=nixl", extra_env={"ASYNCRL_REDIS_URL": external})
    argv = job["argv"]
    assert argv[2] == "configs/gsm8k_qwen2.5_0.5b.yaml" and argv[-1] == "queue.storage=nixl"
    cfg = launched(argv, tmp_path, monkeypatch, {"ASYNCRL_REDIS_URL": job["redis_url"]})
    assert_multinode(argv, cfg)
    assert cfg.queue.storage == "nixl" and cfg.weights.backend == "nccl" and cfg.queue.redis_url == external
    assert "redis.conf" not in job["seen"]


@pytest.mark.timeout(60)
def test_there_are_scripts():
    names = {p.name for p in SCRIPTS}
    assert {"start_cluster.sh", "asyncrl.sbatch", "sim_cluster.sh"} <= names


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_shell_script_passes_bash_n_and_shellcheck(path: Path):
    subprocess.run(["bash", "-n", str(path)], check=True, timeout=30)
    done = subprocess.run([tool("shellcheck"), "--shell=bash", str(path)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stdout
