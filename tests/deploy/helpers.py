"""What the deploy checks compare against: the settings the code reads, the metric names the app
exports, the metric names a PromQL expression uses, and promtool."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from nodes.agent.config import ENV as AGENT_ENV

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

_READ = re.compile(r"""env(?:\.[a-z_]+)?\(\s*["']([A-Z][A-Z0-9_]*)["']""")


def portal_settings() -> set[str]:
    """Environment variables portal/settings.py reads (the same pattern as test_env_example)."""
    return set(_READ.findall((ROOT / "portal" / "settings.py").read_text())) | {"DJANGO_SETTINGS_MODULE"}


def agent_settings() -> set[str]:
    """Environment variables gpupool-agent reads (nodes/agent/config.py)."""
    return set(AGENT_ENV) | {"GPUPOOL_AGENT_CONFIG"}


def interpolations(text: str) -> set[str]:
    """``${VAR}``, ``${VAR:-default}``, ``${VAR:?message}`` names in a compose value ($$ escapes)."""
    return set(re.findall(r"(?<!\$)\$\{([A-Za-z_][A-Za-z0-9_]*)", text))


# --- metrics -------------------------------------------------------------------------------------

_SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "unknown": ("",),
}
# Series Prometheus adds to every target; no application exports them.
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def exported_series(metrics_text: str) -> set[str]:
    """Every series name a scrape of this exposition can produce (families without samples too)."""
    names = set()
    for family in text_string_to_metric_families(metrics_text):
        names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def series_family(name: str) -> str:
    """``x_bucket`` / ``x_total`` -> ``x``: the name an app registers."""
    for suffix in ("_bucket", "_sum", "_count", "_total", "_created"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


_PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
    "bool", "inf", "nan",
}  # fmt: skip


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions, aggregations,
    keywords, label names (matchers, by/without/on lists), durations or Grafana variables."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    e = re.sub(r"\{[^}]*\}", " ", e)
    e = re.sub(r"\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", " ", e)
    names = set()
    for match in re.finditer(r"(?<![\w.])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[match.end() :].lstrip().startswith("("):
            continue
        if match.group().lower() in _PROMQL_WORDS:
            continue
        names.add(match.group())
    return names


def exposed_name(name: str, kind: str) -> set[str]:
    """The series names a metric of this type and registered name shows in /metrics."""
    base = name.removesuffix("_total") if kind == "counter" else name
    return {base + suffix for suffix in _SUFFIXES[kind]}


# --- promtool -----------------------------------------------------------------------------------


def promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is missing: run scripts/install-system-deps (Debian package prometheus)"
    return subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=60)
