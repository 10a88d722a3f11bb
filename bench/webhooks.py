"""Webhooks: what recording events costs the change that publishes them, and attempts per second.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/test .venv/bin/python bench/webhooks.py

Makes (drops first) a database of its own (``gpupool_hookbench``) with ``--tenants`` tenants, then:

1. Recording: ``portal.events.publish_many`` of a batch of ``--batch`` workload.state events spread
   over the tenants (a scheduling cycle's shape), in a transaction that is rolled back (after one
   query of its own, as a change's transaction has begun by then), without the webhooks receiver
   (the baseline), with no
   endpoint, with one endpoint for a tenth of the tenants, and with one for every tenant; and one
   ``publish`` of one event without endpoints (a single transition's cost). Medians of ``--repeat``.
2. Attempts: ``--attempts`` deliveries, each one full attempt in this process (claim, sign, POST to
   a loopback receiver, record), one after another: attempts/s and the median attempt.

The last line printed is JSON with the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pgdb import django_on_own_database, drop_database  # noqa: E402


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return round(statistics.median(times), 3)


class _Rollback(Exception):
    pass


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--attempts", type=int, default=300)
    parser.add_argument("--db-name", default="gpupool_hookbench")
    args = parser.parse_args()
    key = "YmVuY2gtb25seS1rZXktZm9yLXdlYmhvb2stc2VjcmU="  # bench only
    base = django_on_own_database(args.db_name, ROOT, WEBHOOK_ALLOW_LOOPBACK="1", SECRETS_ENCRYPTION_KEYS=key)
    try:
        return run(args)
    finally:
        from django.db import connections

        connections.close_all()
        drop_database(base, args.db_name)


def run(args) -> int:
    from django.core.management import call_command
    from django.db import transaction

    call_command("migrate", verbosity=0)
    from portal.actors import Actor
    from portal.events import publish, publish_many
    from portal.models import Tenant
    from webhooks.models import WebhookDelivery, WebhookEndpoint
    from webhooks.services.deliveries import delivery_attempt
    from webhooks.services.endpoints import endpoint_create

    tenants = Tenant.objects.bulk_create(
        Tenant(slug=f"bench-{i}", name=f"Bench {i}") for i in range(args.tenants)
    )
    events = [
        (
            tenants[i % len(tenants)].pk,
            {"type": "workload.state", "workload_id": i, "from": "queued", "to": "scheduled"},
        )
        for i in range(args.batch)
    ]

    def batch():
        try:
            with transaction.atomic():
                Tenant.objects.filter(pk=tenants[0].pk).exists()
                publish_many(events=events)
                raise _Rollback
        except _Rollback:
            pass

    def one():
        try:
            with transaction.atomic():
                Tenant.objects.filter(pk=tenants[0].pk).exists()  # the change's own work: BEGIN done
                publish(tenant_id=tenants[0].pk, event=events[0][1])
                raise _Rollback
        except _Rollback:
            pass

    figures = {"batch": args.batch, "tenants": args.tenants}
    # Without the webhooks receiver: what publishing cost before (the baseline).
    from portal.signals import tenant_events

    tenant_events.disconnect(dispatch_uid="webhooks.tenant_events")
    figures["one_event_baseline_ms"] = _median_ms(one, args.repeat * 5)
    figures["batch_baseline_ms"] = _median_ms(batch, args.repeat)
    from webhooks.services.events import on_tenant_events

    tenant_events.connect(on_tenant_events, dispatch_uid="webhooks.tenant_events")
    figures["one_event_no_endpoint_ms"] = _median_ms(one, args.repeat * 5)
    figures["batch_no_endpoint_ms"] = _median_ms(batch, args.repeat)
    for share, label in ((10, "batch_tenth_with_endpoint_ms"), (1, "batch_all_with_endpoint_ms")):
        WebhookEndpoint.objects.all().delete()
        for t in tenants[::share]:
            endpoint_create(tenant=t, url="http://127.0.0.1:9/x", event_types=["*"], actor=Actor.system())
        figures[label] = _median_ms(batch, args.repeat)
        print(label, figures[label], flush=True)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")
            self.close_connection = True

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    Thread(target=server.serve_forever, daemon=True).start()
    WebhookEndpoint.objects.all().delete()
    endpoint_create(
        tenant=tenants[0],
        url=f"http://127.0.0.1:{server.server_address[1]}/in",
        event_types=["*"],
        actor=Actor.system(),
    )
    with transaction.atomic():
        publish_many(events=[(tenants[0].pk, e) for _, e in events[: args.attempts]])
    ids = list(WebhookDelivery.objects.order_by("pk").values_list("pk", flat=True))
    times = []
    start = time.perf_counter()
    for pk in ids:
        t0 = time.perf_counter()
        delivery_attempt(delivery_id=pk)
        times.append((time.perf_counter() - t0) * 1000)
    elapsed = time.perf_counter() - start
    server.shutdown()
    assert WebhookDelivery.objects.filter(state="succeeded").count() == len(ids)
    figures["attempts_per_s"] = round(len(ids) / elapsed, 1)
    figures["attempt_median_ms"] = round(statistics.median(times), 2)
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
