"""With production values, ``manage.py check --deploy`` reports nothing; without a key it refuses."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

from cryptography.fernet import Fernet

ROOT = Path(__file__).resolve().parents[2]


def _manage(*args: str, env: dict[str, str], tmp_path: Path) -> subprocess.CompletedProcess:
    drop = {"DEBUG", "SECRET_KEY", "SECRETS_ENCRYPTION_KEYS", "DJANGO_SETTINGS_MODULE"}
    base = {k: v for k, v in os.environ.items() if k not in drop}
    base.update(
        {
            "DJANGO_SETTINGS_MODULE": "portal.settings",
            "GPUPOOL_VAR_DIR": str(tmp_path / "var"),
            "DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite3'}",
        }
    )
    base.update(env)
    return subprocess.run(
        [sys.executable, "manage.py", *args], cwd=ROOT, env=base, capture_output=True, text=True, timeout=120
    )


def test_check_deploy_is_clean_with_production_settings(tmp_path):
    result = _manage(
        "check",
        "--deploy",
        "--fail-level",
        "DEBUG",
        env={
            "DEBUG": "0",
            "SECRET_KEY": secrets.token_urlsafe(64),
            "ALLOWED_HOSTS": "gpupool.example.com",
            "CSRF_TRUSTED_ORIGINS": "https://gpupool.example.com",
            "SECRETS_ENCRYPTION_KEYS": Fernet.generate_key().decode(),
        },
        tmp_path=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The one silenced: HSTS preload, off unless the operator asks (SECURE_HSTS_PRELOAD).
    assert "System check identified no issues (1 silenced)." in result.stdout


def test_check_deploy_flags_the_development_defaults(tmp_path):
    result = _manage("check", "--deploy", env={"DEBUG": "1"}, tmp_path=tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "gpupool.E001" in output  # the development secret key
    assert "gpupool.E002" in output  # no key of its own for tenant secrets
    assert "security.W018" in output  # DEBUG on


def test_production_refuses_to_start_without_a_secret_key(tmp_path):
    result = _manage("check", env={"DEBUG": "0"}, tmp_path=tmp_path)
    assert result.returncode != 0
    assert "SECRET_KEY must be set" in result.stderr
