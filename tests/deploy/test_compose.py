"""deploy/compose.yaml and deploy/Dockerfile against the services gpupool needs and the settings
the code reads (no Docker engine runs in CI: the file is parsed and checked)."""

from __future__ import annotations

import re
import shlex
from urllib.parse import urlsplit

import pytest
import yaml

from tests.deploy.helpers import DEPLOY, ROOT, agent_settings, interpolations, portal_settings

QUEUES = {"scheduling", "commands", "metering", "default"}
REQUIRED = {"postgres", "redis", "migrate", "web", "agent-web", "beat", "fleet"} | {
    f"worker-{q}" for q in QUEUES
}
# Docker's default CPU weight (cpu_shares) of a container that sets none.
DEFAULT_CPU_SHARES = 1024
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


def option(cmd: list[str], name: str) -> str | None:
    """The value of ``--name=value`` or ``--name value`` in a command."""
    for i, arg in enumerate(cmd):
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
        if arg == name and i + 1 < len(cmd):
            return cmd[i + 1]
    return None


def cpu_shares(service: dict) -> int:
    return int(service.get("cpu_shares", DEFAULT_CPU_SHARES))


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
    # Its schedule is in the database (portal/beat.py): no schedule file, no volume; the health
    # check asks the database when beat last saved an entry.
    assert "volumes" not in beat and "--schedule" not in " ".join(command(beat))
    assert beat["healthcheck"]["test"] == ["CMD", "python", "-m", "portal.beat_probe", "600"]


def test_the_metering_worker_runs_prefork(services):
    """Time limits and task_reject_on_worker_lost act only in the prefork pool."""
    assert "--pool=prefork" in command(services["worker-metering"])


def test_web_is_uvicorn_with_several_workers(services):
    cmd = command(services["web"])
    assert cmd[:2] == ["uvicorn", "portal.asgi:application"]
    workers = [int(arg.split("=", 1)[1]) for arg in cmd if arg.startswith("--workers=")]
    assert workers and workers[0] > 1
    assert "--host=0.0.0.0" in cmd


def test_agent_web_is_the_web_app_on_a_port_of_its_own(services):
    web, agent = services["web"], services["agent-web"]
    cmd = command(agent)
    assert cmd[:2] == ["uvicorn", "portal.asgi:application"]
    # The same server and flags as web; only the number of processes may differ.
    assert [a for a in cmd if not a.startswith("--workers=")] == [
        a for a in command(web) if not a.startswith("--workers=")
    ]
    assert int(option(cmd, "--workers")) >= 1
    # Published on a host port of its own, to the port uvicorn listens on.
    published = {str(p).rsplit(":", 1)[0]: str(p).rsplit(":", 1)[1] for p in agent["ports"]}
    web_published = {str(p).rsplit(":", 1)[0] for p in web["ports"]}
    assert set(published.values()) == {option(cmd, "--port")}
    assert not set(published) & web_published


def test_every_background_service_has_fewer_cpu_shares_than_web(services):
    """Each container is one group to the kernel's scheduler, weighed against the others whatever
    its processes: the agent ingress, the workers, beat and the simulated fleet must each weigh
    less than web, or tenants' requests wait behind them on a contended host."""
    assert "cpu_shares" not in services["web"] or cpu_shares(services["web"]) == DEFAULT_CPU_SHARES
    web = cpu_shares(services["web"])
    background = {name for name, service in services.items() if is_app(service)} - {"web", "migrate"}
    assert background >= {"agent-web", "beat", "fleet"} | {f"worker-{q}" for q in QUEUES}
    assert {
        name: cpu_shares(services[name]) for name in background if cpu_shares(services[name]) >= web
    } == {}


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
    # The web checks ask /readyz, on the port uvicorn listens on.
    for name in ("web", "agent-web"):
        check = " ".join(services[name]["healthcheck"]["test"])
        assert f"127.0.0.1:{option(command(services[name]), '--port')}/readyz" in check, name


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


def test_fleet_agents_reach_agent_web_and_it_serves_them(services):
    fleet, agent = services["fleet"], services["agent-web"]
    assert command(fleet)[:2] == ["sh", "-c"]
    url = urlsplit(option(shlex.split(command(fleet)[2]), "--portal-url"))
    assert url.hostname == "agent-web", url
    assert str(url.port) == option(command(agent), "--port")
    assert fleet["depends_on"]["agent-web"]["condition"] == "service_healthy"
    # Over plain HTTP on the compose network: agent-web must accept the name the fleet calls it by
    # (Django answers 400 to another Host) and must not redirect plain HTTP to HTTPS.
    env = agent["environment"]
    hosts = re.sub(r"\$\{[^}]*\}", "", env["ALLOWED_HOSTS"]).split(",")
    assert url.hostname in hosts
    assert "${ALLOWED_HOSTS" in env["ALLOWED_HOSTS"]  # and still the public names of deploy/.env
    if url.scheme == "http":
        assert str(env.get("SECURE_SSL_REDIRECT")).lower() in ("0", "false", "no", "off")
        # agent-web is not loopback: the agents refuse plain HTTP unless allowed explicitly.
        assert "--allow-insecure-http" in shlex.split(command(fleet)[2])


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


def test_each_app_service_names_its_database_connections(services):
    """pg_stat_activity (and the server's log, %a) tells which service a backend works for."""
    names = {
        name: service["environment"]["DB_APPLICATION_NAME"]
        for name, service in services.items()
        if is_app(service)
    }
    assert names == {name: f"gpupool-{name}" for name in names}
