"""deploy/k8s: every manifest kustomize loads, checked for the fields gpupool relies on.

kubeconform is on neither PyPI nor npm here and needs schemas from the network, so the schema
check is this: known apiVersion/kind pairs and the fields below."""

from __future__ import annotations

import re
import subprocess
from collections import Counter

import pytest
import yaml

from tests.deploy.helpers import DEPLOY, agent_settings, portal_settings

K8S = DEPLOY / "k8s"
KINDS = {
    ("v1", "Namespace"), ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "Service"),
    ("apps/v1", "Deployment"), ("apps/v1", "DaemonSet"), ("batch/v1", "Job"),
    ("policy/v1", "PodDisruptionBudget"), ("autoscaling/v2", "HorizontalPodAutoscaler"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("networking.k8s.io/v1", "Ingress"),
}  # fmt: skip
QUEUES = {"scheduling", "commands", "metering", "default"}
# The uvicorn Deployments: gpupool-web (tenants) and gpupool-agent-web (the agents' /agent/).
WEB_TIERS = ("gpupool-web", "gpupool-agent-web")
# hostPath volumes of the agent and why (the same list heads agent-daemonset.yaml).
AGENT_HOST_PATHS = {
    "/var/lib/gpupool-agent": "DirectoryOrCreate",
    "/var/run/docker.sock": "Socket",
    "/etc/gpupool-agent": "DirectoryOrCreate",
}
# Read by the NVIDIA container runtime (not by gpupool) to expose the GPUs and NVML.
RUNTIME_ENV = {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}


@pytest.fixture(scope="module")
def kustomization() -> dict:
    return yaml.safe_load((K8S / "kustomization.yaml").read_text())


@pytest.fixture(scope="module")
def manifests(kustomization) -> list[dict]:
    docs = []
    for resource in kustomization["resources"]:
        path = K8S / resource
        assert path.is_file(), f"kustomization.yaml lists {resource}, which does not exist"
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    listed = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert listed == set(kustomization["resources"]), "every manifest is a kustomize resource"
    return docs


def by_kind(manifests, kind) -> dict[str, dict]:
    return {m["metadata"]["name"]: m for m in manifests if m["kind"] == kind}


def pod_specs(manifests):
    for m in manifests:
        if m["kind"] in ("Deployment", "DaemonSet", "Job"):
            yield m, m["spec"]["template"]["spec"]


def containers(spec):
    return spec.get("initContainers", []) + spec["containers"]


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def test_api_versions_and_kinds_are_valid(manifests, kustomization):
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization" and kustomization["namespace"] == "gpupool"
    for m in manifests:
        assert (m["apiVersion"], m["kind"]) in KINDS, (m["apiVersion"], m["kind"])
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", m["metadata"]["name"])
        assert "namespace" not in m["metadata"], "kustomize sets the namespace"
    names = Counter((m["kind"], m["metadata"]["name"]) for m in manifests)
    assert max(names.values()) == 1


def test_workload_selectors_match_their_pods(manifests):
    for m, _ in pod_specs(manifests):
        if m["kind"] != "Job":
            assert matches(m["spec"]["selector"], m["spec"]["template"]["metadata"]["labels"]), m["metadata"]


def test_every_container_has_requests_and_limits_and_our_image(manifests, kustomization):
    images = {i["name"] for i in kustomization["images"]}
    for m, spec in pod_specs(manifests):
        for c in containers(spec):
            for part in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][part]), (m["metadata"]["name"], c["name"])
            assert c["image"] in images


def selected(manifests, selector: dict) -> list[str]:
    """The Deployments whose pods a Service or PodDisruptionBudget selector matches."""
    return [
        name
        for name, d in by_kind(manifests, "Deployment").items()
        if matches({"matchLabels": selector}, d["spec"]["template"]["metadata"]["labels"])
    ]


def parse_cpu(value) -> float:
    """A CPU quantity in cores: "250m" -> 0.25, "2" -> 2.0."""
    text = str(value)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


@pytest.mark.parametrize("name", WEB_TIERS)
def test_web_probes_healthz_and_readyz(manifests, name):
    web = by_kind(manifests, "Deployment")[name]
    container = web["spec"]["template"]["spec"]["containers"][0]
    port_names = {p["name"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["startupProbe"]["httpGet"]["path"] == "/healthz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in port_names | {8000}
    assert container["command"][:2] == ["uvicorn", "portal.asgi:application"]
    # Probes come by pod IP, which the app answers before host validation (ProbeMiddleware):
    # ALLOWED_HOSTS stays the public names only.
    assert "ALLOWED_HOSTS" not in {e["name"] for e in container.get("env", [])}


def test_agent_web_is_the_web_app_on_pods_of_its_own(manifests):
    deployments = by_kind(manifests, "Deployment")
    web, agent = (deployments[name]["spec"]["template"] for name in WEB_TIERS)
    web_c, agent_c = web["spec"]["containers"][0], agent["spec"]["containers"][0]
    # The same image, app, flags and settings: only where the traffic comes from differs.
    for key in ("image", "command", "ports", "envFrom"):
        assert agent_c[key] == web_c[key], key
    assert agent["metadata"]["annotations"] == web["metadata"]["annotations"]  # scraped like web
    assert agent["metadata"]["labels"]["app.kubernetes.io/component"] == "agent-web"
    # Its own pods: web's selector does not take them, and the other way round.
    assert not matches(deployments["gpupool-web"]["spec"]["selector"], agent["metadata"]["labels"])
    assert not matches(deployments["gpupool-agent-web"]["spec"]["selector"], web["metadata"]["labels"])
    # A lower CPU request than web's: its weight when a node's CPU is contended.
    cpu = [parse_cpu(c["resources"]["requests"]["cpu"]) for c in (agent_c, web_c)]
    assert cpu[0] < cpu[1]


def test_workers_one_deployment_per_queue_with_liveness(manifests):
    served = {}
    for name, d in by_kind(manifests, "Deployment").items():
        container = d["spec"]["template"]["spec"]["containers"][0]
        if container["command"][:4] == ["celery", "-A", "portal", "worker"]:
            queues = [a.split("=", 1)[1] for a in container["command"] if a.startswith("--queues=")]
            assert len(queues) == 1, name
            served[name] = queues[0]
            assert "--hostname=celery@%h" in container["command"]
            assert (
                'inspect ping --timeout 10 -d "celery@$HOSTNAME"'
                in container["livenessProbe"]["exec"]["command"][-1]
            )
    assert set(served.values()) == QUEUES
    assert all(name == f"gpupool-worker-{q}" for name, q in served.items())


def test_exactly_one_beat_recreated(manifests):
    beats = [
        d
        for d in by_kind(manifests, "Deployment").values()
        if d["spec"]["template"]["spec"]["containers"][0]["command"][:4] == ["celery", "-A", "portal", "beat"]
    ]
    assert len(beats) == 1
    beat = beats[0]
    assert beat["spec"]["replicas"] == 1 and beat["spec"]["strategy"] == {"type": "Recreate"}
    hpa_targets = {
        h["spec"]["scaleTargetRef"]["name"] for h in by_kind(manifests, "HorizontalPodAutoscaler").values()
    }
    assert beat["metadata"]["name"] not in hpa_targets
    # The schedule is in the database (portal/beat.py): no schedule file and no volume for one; the
    # liveness probe asks the database when beat last saved an entry.
    pod = beat["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert not any(a.startswith("--schedule") for a in container["command"])
    assert [v["name"] for v in pod["volumes"]] == ["tmp"]
    assert container["livenessProbe"]["exec"]["command"] == ["python", "-m", "portal.beat_probe", "600"]


def test_the_metering_worker_runs_prefork(manifests):
    """Time limits and task_reject_on_worker_lost act only in the prefork pool."""
    (container,) = by_kind(manifests, "Deployment")["gpupool-worker-metering"]["spec"]["template"]["spec"][
        "containers"
    ]
    assert "--pool=prefork" in container["command"]


def test_autoscaled_deployments_leave_replicas_to_the_hpa(manifests):
    deployments = by_kind(manifests, "Deployment")
    hpas = by_kind(manifests, "HorizontalPodAutoscaler").values()
    targets = set()
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment" and ref["apiVersion"] == "apps/v1"
        assert ref["name"] in deployments, f"HPA target {ref['name']} does not exist"
        assert 1 <= hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
        assert "replicas" not in deployments[ref["name"]]["spec"], ref["name"]
        targets.add(ref["name"])
    assert targets == set(WEB_TIERS) | {f"gpupool-worker-{q}" for q in QUEUES}


def test_each_pdb_selects_its_own_deployments_pods_only(manifests):
    pdbs = by_kind(manifests, "PodDisruptionBudget")
    assert set(pdbs) == set(WEB_TIERS)
    for name, pdb in pdbs.items():
        owner = by_kind(manifests, "Deployment")[name]
        assert matches(pdb["spec"]["selector"], owner["spec"]["template"]["metadata"]["labels"]), name
        for m, _ in pod_specs(manifests):
            if m is not owner:
                labels = m["spec"]["template"]["metadata"]["labels"]
                assert not matches(pdb["spec"]["selector"], labels), (name, m["metadata"]["name"])
        assert pdb["spec"]["minAvailable"] >= 1


def test_each_service_reaches_exactly_one_web_tier_on_a_port_its_container_has(manifests):
    deployments = by_kind(manifests, "Deployment")
    reached = set()
    for name, service in by_kind(manifests, "Service").items():
        targets = selected(manifests, service["spec"]["selector"])
        assert len(targets) == 1 and targets[0] in WEB_TIERS, (name, targets)
        container = deployments[targets[0]]["spec"]["template"]["spec"]["containers"][0]
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= {p["name"] for p in container["ports"]}
        reached.add(targets[0])
    assert reached == set(WEB_TIERS)


def test_ingress_sends_agents_to_agent_web_and_the_rest_to_web(manifests):
    services = by_kind(manifests, "Service")
    paths = {}
    for ingress in by_kind(manifests, "Ingress").values():
        for rule in ingress["spec"]["rules"]:
            assert rule["host"] == "gpupool.example.com"  # one public URL for tenants and agents
            for path in rule["http"]["paths"]:
                assert path["pathType"] == "Prefix"
                backend = path["backend"]["service"]
                assert backend["name"] in services, backend["name"]
                assert backend["port"]["name"] in {
                    p["name"] for p in services[backend["name"]]["spec"]["ports"]
                }
                # The Deployment whose pods the backend Service selects.
                (target,) = selected(manifests, services[backend["name"]]["spec"]["selector"])
                assert path["path"] not in paths, f"{path['path']} is routed twice"
                paths[path["path"]] = (target, ingress)
    assert {p: target for p, (target, _) in paths.items()} == {
        "/": "gpupool-web",
        "/ws/": "gpupool-web",
        "/agent/": "gpupool-agent-web",
    }
    timeout = "nginx.ingress.kubernetes.io/proxy-read-timeout"
    assert int(paths["/ws/"][1]["metadata"]["annotations"][timeout]) >= 3600
    # The command long poll waits up to NODE_COMMANDS_MAX_WAIT_S (default 30 s) before answering.
    assert int(paths["/agent/"][1]["metadata"]["annotations"][timeout]) > 30


def test_migration_job_and_init_containers(manifests):
    job = by_kind(manifests, "Job")["gpupool-migrate"]
    spec = job["spec"]["template"]["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["containers"][0]["command"] == ["python", "manage.py", "migrate", "--noinput"]
    for name, d in by_kind(manifests, "Deployment").items():
        inits = d["spec"]["template"]["spec"]["initContainers"]
        assert "migrate --check" in inits[0]["command"][-1], name


def test_agent_daemonset_on_gpu_nodes_with_only_the_documented_host_access(manifests):
    ds = by_kind(manifests, "DaemonSet")["gpupool-agent"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia"
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not spec.get(key), key
    host_paths = {v["hostPath"]["path"]: v["hostPath"]["type"] for v in spec["volumes"] if "hostPath" in v}
    assert host_paths == AGENT_HOST_PATHS
    header = (K8S / "agent-daemonset.yaml").read_text().split("apiVersion:", 1)[0]
    for path in host_paths:
        assert path in header, f"{path} is not explained at the top of agent-daemonset.yaml"
    agent = spec["containers"][0]
    assert agent["command"] == ["gpupool-agent", "run"]
    assert "nvidia.com/gpu" not in agent["resources"]["limits"], (
        "the agent must not take GPUs from the scheduler"
    )
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    # The docker runtime speaks the Engine API over the socket: no docker CLI from the host.
    assert "/usr/bin/docker" not in mounts and "/var/run/docker.sock" in mounts
    env = {e["name"]: e for e in agent["env"]}
    assert env["GPUPOOL_HOSTNAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"


def test_nothing_privileged(manifests):
    for m, spec in pod_specs(manifests):
        for c in containers(spec):
            sc = c.get("securityContext", {})
            assert sc.get("privileged") is not True, (m["metadata"]["name"], c["name"])
            assert sc.get("allowPrivilegeEscalation") is False, (m["metadata"]["name"], c["name"])
            assert sc.get("capabilities") == {"drop": ["ALL"]}, (m["metadata"]["name"], c["name"])
        if m["kind"] != "DaemonSet":
            assert spec["securityContext"]["runAsNonRoot"] is True, m["metadata"]["name"]
    assert "privileged: true" not in "".join(p.read_text() for p in K8S.glob("*.yaml"))


def test_every_variable_set_is_a_setting_the_code_reads(manifests):
    portal, agent = portal_settings(), agent_settings()
    configmaps, secrets = by_kind(manifests, "ConfigMap"), by_kind(manifests, "Secret")
    assert set(configmaps["gpupool-config"]["data"]) <= portal
    assert set(secrets["gpupool-secrets"]["stringData"]) <= portal
    assert set(configmaps["gpupool-agent-config"]["data"]) <= agent
    for m, spec in pod_specs(manifests):
        known = agent | RUNTIME_ENV if m["kind"] == "DaemonSet" else portal
        for c in containers(spec):
            env = c.get("env", [])
            names = [e["name"] for e in env]
            # A helper from the downward API is allowed when a setting's value uses it: $(POD_IP).
            helpers = {
                e["name"]
                for e in env
                if "fieldRef" in e.get("valueFrom", {})
                and any(f"$({e['name']})" in str(o.get("value", "")) for o in env if o["name"] in known)
            }
            unknown = set(names) - known - helpers
            assert not unknown, f"{m['metadata']['name']}/{c['name']} sets {sorted(unknown)}"
            for ref in c.get("envFrom", []):
                name = (ref.get("configMapRef") or ref.get("secretRef"))["name"]
                assert name in configmaps or name in secrets, name


def test_each_workload_names_its_database_connections(manifests):
    """Every container of web, agent-web, the workers, beat and the migration Job gives PostgreSQL
    its Deployment's (or Job's) name as application_name."""
    named = 0
    for m, spec in pod_specs(manifests):
        if m["kind"] not in ("Deployment", "Job"):
            continue
        for c in containers(spec):
            env = {e["name"]: e.get("value") for e in c.get("env", [])}
            assert env.get("DB_APPLICATION_NAME") == m["metadata"]["name"], (m["metadata"]["name"], c["name"])
            named += 1
    assert named >= 8


def test_each_agent_pod_reads_only_its_own_node_s_bootstrap_token(manifests):
    """The hole: every node's bootstrap token sat in one Secret that every agent pod mounted whole,
    so the pod of any node (root next to the docker socket) could register as any other. Now no
    Secret holds bootstrap tokens: the node's provisioning leaves its own token on the node, and
    only the init container mounts that host directory, read-only."""
    secrets = by_kind(manifests, "Secret")
    assert set(secrets) == {"gpupool-secrets"}
    assert not any("gpb_" in str(v) for s in secrets.values() for v in s["stringData"].values())
    ds = by_kind(manifests, "DaemonSet")["gpupool-agent"]
    spec = ds["spec"]["template"]["spec"]
    assert spec["automountServiceAccountToken"] is False  # no API token: it cannot read any Secret
    for volume in spec["volumes"]:
        assert "secret" not in volume and "projected" not in volume, volume["name"]
    for c in containers(spec):
        for env in c.get("env", []):
            assert "secretKeyRef" not in env.get("valueFrom", {}), (c["name"], env["name"])
        assert not any("secretRef" in ref for ref in c.get("envFrom", [])), c["name"]
    bootstrap = next(
        v["name"] for v in spec["volumes"] if v.get("hostPath", {}).get("path") == "/etc/gpupool-agent"
    )
    users = {
        c["name"]: m for c in containers(spec) for m in c.get("volumeMounts", []) if m["name"] == bootstrap
    }
    assert list(users) == ["bootstrap-token"] and users["bootstrap-token"]["readOnly"] is True
    readme = (K8S.parent / "README.md").read_text()
    assert "/etc/gpupool-agent/bootstrap-token" in readme and "gpupool-agent-bootstrap" not in readme


@pytest.mark.parametrize(
    ("file_text", "expected"),
    [
        ("gpb_0123abcd_s3cr-et_x\n", 'bootstrap_token = "gpb_0123abcd_s3cr-et_x"\n'),
        (None, ""),  # no token left on the node: the agent uses its credential
        ('gpb_x"\nportal_url = "http://evil', ""),  # not a token: nothing reaches the config file
    ],
)
def test_the_bootstrap_init_container_copies_a_token_and_nothing_else(
    manifests, tmp_path, file_text, expected
):
    spec = by_kind(manifests, "DaemonSet")["gpupool-agent"]["spec"]["template"]["spec"]
    init = next(c for c in spec["initContainers"] if c["name"] == "bootstrap-token")
    host = tmp_path / "etc-gpupool-agent"
    host.mkdir()
    if file_text is not None:
        (host / "bootstrap-token").write_text(file_text)
    script = init["command"][2].replace("/etc/gpupool-agent", str(host))
    config = tmp_path / "agent.toml"
    env = {"PATH": "/usr/bin:/bin", "GPUPOOL_AGENT_CONFIG": str(config)}
    subprocess.run([*init["command"][:2], script], env=env, check=True, timeout=30)
    assert config.read_text() == expected
    assert config.stat().st_mode & 0o077 == 0
