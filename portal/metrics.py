"""``/metrics`` in the Prometheus text format; apps add their collectors to the default registry.

Values that Celery workers produce are stored in the database (``StoredMetric``,
``metrics_store``) and read at scrape time (``StoredCollector``): only the web tier is scraped.

With ``METRICS_TOKEN`` set, a scrape must send ``Authorization: Bearer <METRICS_TOKEN>``.
"""

import logging
import math
import secrets
import time
from collections import defaultdict
from dataclasses import dataclass

import orjson
from django.conf import settings
from django.http import HttpResponse
from django.views.decorators.cache import never_cache
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

logger = logging.getLogger(__name__)


def authorized(request) -> bool:
    """The bearer token METRICS_TOKEN; with none set, /metrics is open only where METRICS_PUBLIC
    says so (default: with DEBUG, as ``make run``): it shows revenue per plan."""
    token = settings.METRICS_TOKEN
    if not token:
        return settings.METRICS_PUBLIC
    sent = request.META.get("HTTP_AUTHORIZATION", "")
    return secrets.compare_digest(sent.encode(), f"Bearer {token}".encode())


def unauthorized(request):
    response = HttpResponse("metrics need a bearer token\n", status=401, content_type="text/plain")
    response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


@never_cache
@require_GET
def metrics(request):
    if not authorized(request):
        return unauthorized(request)
    return HttpResponse(generate_latest(), content_type=CONTENT_TYPE_LATEST)


# --- values produced outside the web tier ---------------------------------------------------------
# Celery workers and beat are not scraped: what they count goes into the database (MetricValue) in
# one upsert per event, and the web tier's collectors read it on each scrape, so every web process
# reports the same cumulative values.

Row = tuple[str, str, str, float, bool]  # (name, labels as JSON, bucket, value, gauge)


@dataclass(frozen=True)
class StoredMetric:
    """A counter, histogram or last-value gauge kept in ``MetricValue`` rows."""

    name: str
    help: str
    kind: str  # "counter", "histogram" or "gauge"
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def _key(self, values: tuple[str, ...]) -> str:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name} takes the labels {self.labels}, got {values}")
        return orjson.dumps([str(v) for v in values]).decode()

    def inc(self, *labels: str, amount: float = 1.0) -> list[Row]:
        assert self.kind == "counter"
        return [(self.name, self._key(labels), "", float(amount), False)]

    def observe(self, value: float, *labels: str) -> list[Row]:
        """The rows of one observation: its bucket (the first bound >= value) and the sum."""
        assert self.kind == "histogram"
        key = self._key(labels)
        bound = next((b for b in self.buckets if value <= b), math.inf)
        return [
            (self.name, key, floatToGoString(bound), 1.0, False),
            (self.name, key, "sum", float(value), False),
        ]

    def set(self, value: float, *labels: str) -> list[Row]:
        assert self.kind == "gauge"
        return [(self.name, self._key(labels), "", float(value), True)]


def metrics_store(rows: list[Row]) -> None:
    """Add the rows to their stored series in one statement (gauges are set). Rows of one series
    are merged first; the statement takes its row locks in key order (no deadlocks between
    workers)."""
    if not rows:
        return
    from django.db import connection
    from django.utils import timezone

    from portal.models import MetricValue

    merged: dict[tuple[str, str, str], tuple[float, bool]] = {}
    for name, labels, bucket, value, gauge in rows:
        old = merged.get((name, labels, bucket))
        merged[(name, labels, bucket)] = (value if gauge or old is None else old[0] + value, gauge)
    table = connection.ops.quote_name(MetricValue._meta.db_table)
    now = timezone.now()
    params: list = []
    for (name, labels, bucket), (value, gauge) in sorted(merged.items()):
        params += [name, labels, bucket, value, gauge, now]
    values = ", ".join(["(%s, %s, %s, %s, %s, %s)"] * len(merged))
    sql = (
        f"INSERT INTO {table} (name, labels, bucket, value, gauge, updated_at) VALUES {values} "
        "ON CONFLICT (name, labels, bucket) DO UPDATE SET "
        f"value = CASE WHEN excluded.gauge THEN excluded.value ELSE {table}.value + excluded.value END, "
        "updated_at = excluded.updated_at"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def metrics_store_safely(rows: list[Row]) -> None:
    """``metrics_store`` for code whose own work must not fail because a metric could not be
    written (the failure is logged)."""
    try:
        metrics_store(rows)
    except Exception:
        logger.warning("Could not store metrics %s", sorted({r[0] for r in rows}), exc_info=True)


def _family(metric: StoredMetric):
    if metric.kind == "counter":
        return CounterMetricFamily(metric.name, metric.help, labels=metric.labels)
    if metric.kind == "histogram":
        return HistogramMetricFamily(metric.name, metric.help, labels=metric.labels)
    return GaugeMetricFamily(metric.name, metric.help, labels=metric.labels)


def stored_families(metrics: list[StoredMetric]):
    """The metrics' families from their stored rows (one query). A gauge without labels and
    without a row reads 0 ("never")."""
    from portal.models import MetricValue

    rows: dict[str, dict[str, dict[str, float]]] = {m.name: defaultdict(dict) for m in metrics}
    for name, labels, bucket, value in MetricValue.objects.filter(name__in=list(rows)).values_list(
        "name", "labels", "bucket", "value"
    ):
        rows[name][labels][bucket] = value
    for metric in metrics:
        family = _family(metric)
        series = rows[metric.name]
        if metric.kind == "gauge" and not metric.labels and not series:
            series[orjson.dumps([]).decode()][""] = 0.0
        for key, cells in sorted(series.items()):
            labels = orjson.loads(key)
            if metric.kind == "histogram":
                total, buckets = 0.0, []
                for bound in (*metric.buckets, math.inf):
                    total += cells.get(floatToGoString(bound), 0.0)
                    buckets.append((floatToGoString(bound), total))
                family.add_metric(labels, buckets, cells.get("sum", 0.0))
            else:
                family.add_metric(labels, cells.get("", 0.0))
        yield family


class StoredCollector(Collector):
    """Exports stored metrics, then whatever ``live()`` yields (gauges read at scrape time). A
    scrape never fails because the database is away: the metrics are left out and it is logged."""

    def __init__(self, metrics: list[StoredMetric], live=None) -> None:
        self.metrics = metrics
        self.live = live

    def describe(self):
        # Names only: registering must not query the database.
        for metric in self.metrics:
            yield _family(metric)

    def collect(self):
        try:
            yield from stored_families(self.metrics)
            if self.live is not None:
                yield from self.live()
        except Exception:
            logger.warning("Stored metrics unavailable", exc_info=True)


_registered: set[str] = set()


def register_once(key: str, collector: Collector) -> None:
    """Adds ``collector`` to the default registry once per process (``AppConfig.ready`` may run
    more than once in tests)."""
    if key not in _registered:
        REGISTRY.register(collector)
        _registered.add(key)


class TtlCache:
    """One value per key, recomputed when older than ``seconds`` (per process)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._values: dict[str, tuple[float, object]] = {}

    def get(self, key: str, compute):
        now = time.monotonic()
        hit = self._values.get(key)
        if hit is not None and now - hit[0] < self.seconds:
            return hit[1]
        value = compute()
        self._values[key] = (now, value)
        return value

    def clear(self) -> None:
        self._values.clear()


# --- Celery: queue depth (read from the broker at scrape time) and task latency (stored) ----------

TASK_LATENCY = StoredMetric(
    "gpupool_celery_task_latency_seconds",
    "From publish (or the ETA) to the start of a task, by queue and task.",
    "histogram",
    ("queue", "task"),
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
REDIS_PRIORITY_SEP = "\x06\x16"  # kombu's Redis transport: queue + sep + priority for priorities > 0
REDIS_PRIORITY_STEPS = (3, 6, 9)


def celery_queue_lengths() -> dict[str, int] | None:
    """Messages waiting in each configured queue: ``LLEN`` on the Redis broker at ``REDIS_URL``
    (priority lists included), or the files of the filesystem broker; None for another broker."""
    queues = [q.name for q in settings.CELERY_TASK_QUEUES]
    url = settings.CELERY_BROKER_URL
    if settings.REDIS_URL and url == settings.REDIS_URL:
        # The broker is the cache's Redis server (both are REDIS_URL): the cache's client reads it.
        from django_redis import get_redis_connection

        pipe = get_redis_connection("default").pipeline(transaction=False)
        prefix = settings.CELERY_BROKER_KEY_PREFIX
        for q in queues:
            for key in (q, *(f"{q}{REDIS_PRIORITY_SEP}{p}" for p in REDIS_PRIORITY_STEPS)):
                pipe.llen(prefix + key)
        counts = pipe.execute()
        per = 1 + len(REDIS_PRIORITY_STEPS)
        return {q: sum(counts[i * per : (i + 1) * per]) for i, q in enumerate(queues)}
    if url.startswith("filesystem://"):
        import os

        folder = settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"]
        names = os.listdir(folder)
        return {q: sum(1 for n in names if n.endswith(f".{q}.msg")) for q in queues}
    return None


def _celery_live():
    queue = GaugeMetricFamily(
        "gpupool_celery_queue_length", "Messages waiting in each Celery queue.", labels=["queue"]
    )
    try:
        lengths = celery_queue_lengths()
    except Exception:
        logger.warning("Celery queue lengths unavailable", exc_info=True)
        lengths = None
    for name, n in sorted((lengths or {}).items()):
        queue.add_metric([name], n)
    yield queue


def register_collector() -> None:
    register_once("portal.celery", StoredCollector([TASK_LATENCY], live=_celery_live))
