"""deploy/compose.yaml and deploy/Dockerfile against the services gpupool needs and the settings
the code reads (no Docker engine runs in CI: the file is parsed and checked)."""

from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy.helpers import DEPLOY, ROOT, agent_settings, interpolations, portal_settings

QUEUES = {"scheduling", "commands", "metering", "default"}
REQUIRED = {"postgres", "redis", "migrate", "web", "beat", "fleet"} | {f"worker-{q}" for q in QUEUES}
# Infrastructure images read their own variables; only these may come from deploy/.env.
INFRA_INTERPOLATIONS = {"POSTGRES_PASSWORD"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict[str, dict]:
    return compose["services"]


def command(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return cmd.split() if isinstance(cmd, str) else [str(part) for part in cmd]


def is_app(service: dict) -> bool:
    return service.get("build", {}).get("dockerfile") == "deploy/Dockerfile"


def long_running(name: str, service: dict) -> bool:
    return service.get("restart") != "no"


def test_required_services_are_present(services):
    assert set(services) >= REQUIRED, f"missing: {sorted(REQUIRED - set(services))}"
    assert services["postgres"]["image"].startswith("postgres:")
    assert services["redis"]["image"].startswith("redis:")


def test_app_services_build_the_image_and_read_the_env_file(services):
    app = {name for name, service in services.items() if is_app(service)}
    assert app == REQUIRED - {"postgres", "redis"}
    for name in app:
        assert services[name]["env_file"] in (".env", [".env"]), name
    assert (DEPLOY / "Dockerfile").is_file()


def test_one_worker_per_queue_and_every_queue_served(services):
    served = {}
    for name, service in services.items():
        cmd = command(service)
        if cmd[:4] == ["celery", "-A", "portal", "worker"]:
            queues = [arg.split("=", 1)[1] for arg in cmd if arg.startswith("--queues=")]
            assert len(queues) == 1 and "," not in queues[0], f"{name}: one queue per worker service"
            served[name] = queues[0]
    assert set(served.values()) == QUEUES
    assert all(name == f"worker-{queue}" for name, queue in served.items())


def test_exactly_one_beat(services):
    beats = [name for name, s in services.items() if command(s)[:4] == ["celery", "-A", "portal", "beat"]]
    assert beats == ["beat"]
    beat = services["beat"]
    assert beat.get("deploy", {}).get("replicas", 1) == 1 and "scale" not in beat
    # Its schedule file lives on a volume, where its health check looks.
    assert any(str(v).endswith(":/var/lib/gpupool") for v in beat["volumes"])
    assert "/var/lib/gpupool/celerybeat-schedule" in " ".join(command(beat))


def test_web_is_uvicorn_with_several_workers(services):
    cmd = command(services["web"])
    assert cmd[:2] == ["uvicorn", "portal.asgi:application"]
    workers = [int(arg.split("=", 1)[1]) for arg in cmd if arg.startswith("--workers=")]
    assert workers and workers[0] > 1
    assert "--host=0.0.0.0" in cmd


def test_migrate_runs_once_before_everything_of_ours(services):
    assert services["migrate"]["restart"] == "no"
    assert command(services["migrate"]) == ["python", "manage.py", "migrate", "--noinput"]
    for name, service in services.items():
        if is_app(service) and name != "migrate":
            assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name
            assert service["depends_on"]["postgres"]["condition"] == "service_healthy", name


def test_long_running_services_have_health_checks_and_restart_policies(services):
    for name, service in services.items():
        if not long_running(name, service):
            continue
        assert service.get("restart") in ("always", "unless-stopped"), name
        check = service.get("healthcheck", {})
        assert check.get("test") and not check.get("disable"), f"{name} has no health check"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), name
    # The worker checks ping their own node: celery@%h is celery@$HOSTNAME inside the container.
    for queue in QUEUES:
        service = services[f"worker-{queue}"]
        assert "--hostname=celery@%h" in command(service)
        assert 'ping --timeout 10 -d "celery@$$HOSTNAME"' in service["healthcheck"]["test"][1]
    # The web check asks /readyz with a host Django accepts.
    web_check = " ".join(services["web"]["healthcheck"]["test"])
    assert "/readyz" in web_check


def test_every_variable_of_our_services_is_a_setting_the_code_reads(services):
    portal, agent = portal_settings(), agent_settings()
    assert len(portal) > 30 and "GPUPOOL_PORTAL_URL" in agent
    for name, service in services.items():
        text = yaml.safe_dump(service)
        if is_app(service):
            known = portal | (agent if name == "fleet" else set())
            unknown = (set(service.get("environment", {})) | interpolations(text)) - known
            assert not unknown, f"{name} sets variables the code does not read: {sorted(unknown)}"
        else:
            unknown = interpolations(text) - INFRA_INTERPOLATIONS
            assert not unknown, f"{name}: {sorted(unknown)}"


def test_app_services_pool_database_connections_like_the_configmap(services):
    docs = yaml.safe_load_all((DEPLOY / "k8s" / "config.yaml").read_text())
    configmap = next(d for d in docs if d["metadata"]["name"] == "gpupool-config")
    size = configmap["data"]["DB_POOL_MAX_SIZE"]
    for name, service in services.items():
        if is_app(service):
            assert service["environment"]["DB_POOL_MAX_SIZE"] == f"${{DB_POOL_MAX_SIZE:-{size}}}", name


def test_env_example_points_at_the_compose_services():
    example = (DEPLOY / ".env.example").read_text()
    assert re.search(r"^DATABASE_URL=postgres://gpupool:[^@]+@postgres:5432/gpupool$", example, re.M)
    assert re.search(r"^REDIS_URL=redis://redis:6379/\d+$", example, re.M)


def test_fleet_reads_the_file_seed_demo_writes(services):
    fleet = services["fleet"]
    assert fleet["profiles"] == ["simulated"]
    script = " ".join(command(fleet))
    path = fleet["environment"]["FLEET_FILE"]
    assert "python manage.py seed_demo &&" in script
    assert f"gpupool-agent fleet --fleet-file {path}" in script
    assert any(str(v).endswith(":" + path.rsplit("/", 1)[0]) for v in fleet["volumes"])


def test_named_volumes_are_declared(compose, services):
    used = {
        str(v).split(":", 1)[0]
        for s in services.values()
        for v in s.get("volumes", [])
        if not str(v).startswith((".", "/"))
    }
    assert used and used <= set(compose["volumes"])


def test_dockerfile_is_slim_non_root_and_collects_static():
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", text, re.M)
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and users[-1].split(":")[0] not in ("root", "0")
    assert "pip install -e ." in text and "manage.py collectstatic --noinput" in text
    env_keys = set(re.findall(r"(?:^ENV |\\\n\s+)([A-Z_][A-Z0-9_]*)=", text, re.M))
    python_runtime = {
        "PYTHONDONTWRITEBYTECODE",
        "PYTHONUNBUFFERED",
        "PIP_NO_CACHE_DIR",
        "PIP_DISABLE_PIP_VERSION_CHECK",
    }
    assert "GPUPOOL_VAR_DIR" in env_keys
    assert env_keys - python_runtime <= portal_settings(), sorted(
        env_keys - python_runtime - portal_settings()
    )
    # Everything the image copies exists in the repository.
    for source in re.findall(r"^COPY (.+) \S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
