"""Where the command line finds its portal and token.

In order: ``GPUPOOL_URL`` and ``GPUPOOL_TOKEN`` in the environment (scripts, CI); else the profile
named by ``--profile`` or ``GPUPOOL_PROFILE``, else the default one that ``gpupool login`` saved.
Profiles (name -> URL) are in ``config.json`` under ``$GPUPOOL_CONFIG_DIR`` (default
``~/.config/gpupool``); their tokens are in the OS keyring when the ``keyring`` package and a
keyring backend are there, else in ``credentials.json`` beside it, readable by its owner only (0600).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from gpupool.errors import GpupoolError

KEYRING_SERVICE = "gpupool"


@dataclass(frozen=True)
class Settings:
    url: str
    token: str
    profile: str | None  # None: from the environment


class NotConfigured(GpupoolError):
    """No portal or token: neither in the environment nor in a saved profile."""


def config_dir() -> Path:
    explicit = os.environ.get("GPUPOOL_CONFIG_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "gpupool"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def _write_private(path: Path, data: dict) -> None:
    """Written whole and owner-only from the first byte (never world-readable, even briefly)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def _keyring():
    """The keyring module when it has a usable backend, else None."""
    if os.environ.get("GPUPOOL_NO_KEYRING"):
        return None
    try:
        import keyring
        from keyring.backends import fail
    except ImportError:
        return None
    if isinstance(keyring.get_keyring(), fail.Keyring):
        return None
    return keyring


def load_profiles() -> dict:
    return _read(config_dir() / "config.json")


def save_profile(name: str, url: str, token: str, *, make_default: bool) -> str:
    """Saves the profile; answers where the token went ("keyring" or the file's path)."""
    data = load_profiles()
    profiles = data.setdefault("profiles", {})
    profiles[name] = {"url": url.rstrip("/")}
    if make_default or not data.get("default"):
        data["default"] = name
    _write_private(config_dir() / "config.json", data)
    keyring = _keyring()
    if keyring is not None:
        keyring.set_password(KEYRING_SERVICE, name, token)
        return "the OS keyring"
    path = config_dir() / "credentials.json"
    creds = _read(path)
    creds[name] = token
    _write_private(path, creds)
    return str(path)


def remove_profile(name: str) -> bool:
    data = load_profiles()
    if name not in data.get("profiles", {}):
        return False
    del data["profiles"][name]
    if data.get("default") == name:
        data["default"] = next(iter(data["profiles"]), None)
    _write_private(config_dir() / "config.json", data)
    keyring = _keyring()
    if keyring is not None:
        with contextlib.suppress(Exception):  # not stored there
            keyring.delete_password(KEYRING_SERVICE, name)
    path = config_dir() / "credentials.json"
    creds = _read(path)
    if creds.pop(name, None) is not None:
        _write_private(path, creds)
    return True


def _token_for(name: str) -> str | None:
    keyring = _keyring()
    if keyring is not None:
        token = keyring.get_password(KEYRING_SERVICE, name)
        if token:
            return token
    return _read(config_dir() / "credentials.json").get(name)


def resolve(profile: str | None) -> Settings:
    env_url, env_token = os.environ.get("GPUPOOL_URL"), os.environ.get("GPUPOOL_TOKEN")
    if env_url and env_token and not profile:
        return Settings(env_url.rstrip("/"), env_token, None)
    data = load_profiles()
    name = profile or os.environ.get("GPUPOOL_PROFILE") or data.get("default")
    if not name:
        raise NotConfigured("Not logged in: run `gpupool login`, or set GPUPOOL_URL and GPUPOOL_TOKEN.")
    entry = data.get("profiles", {}).get(name)
    if entry is None:
        raise NotConfigured(f"No profile named {name!r}: run `gpupool login --profile {name}`.")
    token = env_token or _token_for(name)
    if not token:
        raise NotConfigured(f"No token saved for profile {name!r}: run `gpupool login --profile {name}`.")
    return Settings(env_url.rstrip("/") if env_url else entry["url"], token, name)
