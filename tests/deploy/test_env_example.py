"""Every setting the code reads from the environment is listed in deploy/.env.example."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READ = re.compile(r"""env(?:\.[a-z_]+)?\(\s*["']([A-Z][A-Z0-9_]*)["']""")
LISTED = re.compile(r"^#?\s*([A-Z][A-Z0-9_]*)=", re.MULTILINE)


def settings_read_from_env() -> set[str]:
    return set(READ.findall((ROOT / "portal" / "settings.py").read_text()))


def test_env_example_lists_every_setting():
    listed = set(LISTED.findall((ROOT / "deploy" / ".env.example").read_text()))
    read = settings_read_from_env()
    assert len(read) > 30  # the pattern really finds the settings
    missing = sorted(read - listed)
    assert not missing, f"add these to deploy/.env.example: {missing}"
    stale = sorted(listed - read - {"DJANGO_SETTINGS_MODULE"})
    assert not stale, f"deploy/.env.example lists settings the code no longer reads: {stale}"
