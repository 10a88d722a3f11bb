"""The command line and the Python client against a live portal over real HTTP (pytest-django's
``live_server``: the portal in a thread, on this test's database)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
try:  # `make venv` installs it (pip install -e ./client); a venv made before the split may lack it
    import gpupool  # noqa: F401
except ImportError:
    sys.path.insert(0, str(ROOT / "client" / "src"))

from click.testing import CliRunner  # noqa: E402

from gpupool.cli import cli  # noqa: E402
from tests.scheduling.conftest import cycle, make_node, regions, submit  # noqa: E402, F401  (fixtures)

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(autouse=True)
def _no_cycle_tasks(settings):
    """The tests run scheduling cycles themselves."""
    settings.SCHEDULING_TRIGGER_CYCLES = False


class Cli:
    """``gpupool`` in this process, configured by the environment, against the live portal."""

    def __init__(self, url: str, token: str, monkeypatch, config_dir: Path) -> None:
        self.url, self.token = url, token
        monkeypatch.setenv("GPUPOOL_URL", url)
        monkeypatch.setenv("GPUPOOL_TOKEN", token)
        monkeypatch.setenv("GPUPOOL_CONFIG_DIR", str(config_dir))
        monkeypatch.setenv("GPUPOOL_NO_KEYRING", "1")
        monkeypatch.setenv("GPUPOOL_WAIT_POLL_S", "0.05")
        monkeypatch.delenv("GPUPOOL_PROFILE", raising=False)

    def __call__(self, *args: str, input: str | None = None, code: int | None = 0):
        result = CliRunner().invoke(cli, [str(a) for a in args], input=input, catch_exceptions=False)
        if code is not None:
            assert result.exit_code == code, (result.exit_code, result.stdout, result.stderr)
        return result

    def json(self, *args: str, input: str | None = None):
        result = self("--json", *args, input=input)
        return json.loads(result.stdout)


@pytest.fixture
def gp(live_server, tenant, make_token, monkeypatch, tmp_path) -> Cli:
    return Cli(live_server.url, make_token(tenant), monkeypatch, tmp_path / "config")
