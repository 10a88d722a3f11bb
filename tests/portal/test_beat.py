"""Beat's schedule in the database: synced from settings, edited in the admin, crontabs in UTC,
a run missed while beat was down run when it comes back, and Celery's limits fitted to the tasks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from celery.schedules import crontab
from django.conf import settings
from django_celery_beat.models import CrontabSchedule, PeriodicTask
from django_celery_beat.schedulers import DatabaseScheduler

from portal.beat import Scheduler, beat_schedule_sync
from portal.celery import app

pytestmark = pytest.mark.django_db


def test_the_entries_are_synced_from_settings_with_crontabs_in_utc():
    done = beat_schedule_sync(app=app)
    assert set(done) == set(settings.CELERY_BEAT_SCHEDULE) and set(done.values()) == {"created"}
    run = PeriodicTask.objects.get(name="metering-invoice-run")
    assert run.task == "metering.tasks.invoice_run" and run.enabled
    c = run.crontab
    assert (c.minute, c.hour, c.day_of_month, c.month_of_year, str(c.timezone)) == ("5", "0", "1", "*", "UTC")
    drafts = PeriodicTask.objects.get(name="metering-invoice-drafts").crontab
    assert (drafts.minute, drafts.hour, drafts.day_of_month) == ("5", "0", "2-31")
    dunning = PeriodicTask.objects.get(name="metering-dunning").crontab
    assert (dunning.minute, dunning.hour, dunning.day_of_month) == ("0", "6", "*")
    # options.expires of a settings entry is the row's expiry
    assert PeriodicTask.objects.get(name="metering-costs-to-date").expire_seconds == 60
    assert PeriodicTask.objects.get(name="metering-payments-sweep").interval.every == 600
    assert set(beat_schedule_sync(app=app).values()) == {"updated"}  # again: nothing new


def test_a_change_made_in_the_admin_survives_a_restart_and_a_removed_entry_is_disabled():
    beat_schedule_sync(app=app)
    row = PeriodicTask.objects.get(name="metering-dunning")
    row.crontab, _ = CrontabSchedule.objects.get_or_create(minute="30", hour="9", timezone="UTC")
    row.save()  # staff move dunning to 09:30 UTC
    schedule = dict(settings.CELERY_BEAT_SCHEDULE)
    schedule["metering-dunning"] = {**schedule["metering-dunning"], "schedule": crontab(minute=0, hour=7)}
    del schedule["portal-purge-expired-invitations"]
    done = beat_schedule_sync(app=app, schedule=schedule)
    assert done["metering-dunning"] == "kept" and done["portal-purge-expired-invitations"] == "disabled"
    row.refresh_from_db()
    assert (row.crontab.minute, row.crontab.hour) == ("30", "9")
    assert not PeriodicTask.objects.get(name="portal-purge-expired-invitations").enabled
    # A declaration that changed, on a row nobody edited, is followed.
    schedule["metering-invoice-drafts"] = {
        **schedule["metering-invoice-drafts"],
        "schedule": crontab(minute=15, hour=0, day_of_month="2-31"),
    }
    assert beat_schedule_sync(app=app, schedule=schedule)["metering-invoice-drafts"] == "updated"
    assert PeriodicTask.objects.get(name="metering-invoice-drafts").crontab.minute == "15"


class Recording(Scheduler):
    """The project's scheduler, recording what it sends instead of publishing it."""

    sent: list[str]

    def apply_async(self, entry, producer=None, advance=True, **kwargs):
        self.sent.append(entry.name)


def _tick(scheduler_class) -> list[str]:
    scheduler = scheduler_class(app=app, lazy=False)
    scheduler.sent = []
    for _ in range(len(settings.CELERY_BEAT_SCHEDULE) + 2):
        scheduler.tick()
    scheduler.sync()
    return scheduler.sent


@pytest.mark.django_db(transaction=True)  # the scheduler closes and reopens its connection
def test_a_run_missed_while_beat_was_down_runs_when_it_comes_back():
    beat_schedule_sync(app=app)
    now = datetime.now(UTC)
    last_first = now.replace(day=1, hour=0, minute=5, second=0, microsecond=0)
    if last_first > now:
        last_first = (last_first - timedelta(days=1)).replace(day=1)
    # Beat last ran the monthly invoice run the month before, then was down over the 1st, 00:05.
    PeriodicTask.objects.filter(name="metering-invoice-run").update(
        last_run_at=last_first - timedelta(days=20)
    )
    # Staff moved dunning to twelve hours from now; beat was down when yesterday's ran.
    hour = (now.hour + 12) % 24
    row = PeriodicTask.objects.get(name="metering-dunning")
    row.crontab, _ = CrontabSchedule.objects.get_or_create(minute="0", hour=str(hour), timezone="UTC")
    row.last_run_at = now - timedelta(days=2)
    row.save()
    PeriodicTask.objects.exclude(name__in=["metering-invoice-run", "metering-dunning"]).update(
        last_run_at=now
    )

    sent = _tick(Recording)
    assert sorted(set(sent)) == ["metering-dunning", "metering-invoice-run"] and len(sent) == 2
    run = PeriodicTask.objects.get(name="metering-invoice-run")
    assert run.last_run_at > last_first and run.total_run_count == 1
    # Restarted again: the missed runs are not sent twice (entries every few seconds may be due).
    again = _tick(Recording)
    assert "metering-invoice-run" not in again and "metering-dunning" not in again


def test_the_stock_database_scheduler_would_lose_a_missed_crontab_far_from_now():
    """Why portal.beat.Scheduler loads every row: django-celery-beat's own leaves out crontab
    entries whose hour is more than two hours away, so yesterday's missed run never comes."""
    beat_schedule_sync(app=app)
    hour = (datetime.now(UTC).hour + 12) % 24
    row = PeriodicTask.objects.get(name="metering-dunning")
    row.crontab, _ = CrontabSchedule.objects.get_or_create(minute="0", hour=str(hour), timezone="UTC")
    row.save()
    stock = DatabaseScheduler(app=app, lazy=True)
    assert "metering-dunning" not in {m.name for m in stock.enabled_models()}
    assert "metering-dunning" in {m.name for m in Scheduler(app=app, lazy=True).enabled_models()}


def test_visibility_timeout_outlasts_every_task_and_limits_are_set():
    assert app.conf.beat_scheduler == "portal.beat:Scheduler"
    longest = settings.GPUPOOL_TASK_LONGEST_RUN_S
    countdown = settings.GPUPOOL_TASK_LONGEST_COUNTDOWN_S
    if settings.REDIS_URL:
        options = settings.CELERY_BROKER_TRANSPORT_OPTIONS
        assert longest < options["visibility_timeout"] <= longest + 120
        # A killed worker's task runs again within minutes, not hours.
        assert options["visibility_timeout"] <= 30 * 60
        assert options["unacked_restore_throttle"] == 1 and options["unacked_restore_interval"] <= 10
    app.loader.import_default_modules()
    ours = {name: t for name, t in app.tasks.items() if not name.startswith("celery.")}
    assert "metering.tasks.invoice_run" in ours
    for name, task in ours.items():
        hard = task.time_limit or app.conf.task_time_limit
        soft = task.soft_time_limit or app.conf.task_soft_time_limit
        assert hard and soft and soft < hard, name
        assert hard + countdown <= longest, name
    assert ours["metering.tasks.invoice_run"].time_limit == settings.GPUPOOL_LONG_TASK_TIME_LIMIT_S == 900
    assert app.conf.task_acks_late and app.conf.task_reject_on_worker_lost


def test_a_visibility_timeout_shorter_than_a_task_is_refused_at_start_up():
    from tests.conftest import python_run

    code = "import django; django.setup(); from django.conf import settings; print(settings.CELERY_VISIBILITY_TIMEOUT_S)"
    env = {"DJANGO_SETTINGS_MODULE": "portal.settings", "DEBUG": "1", "REDIS_URL": "redis://127.0.0.1:1/0"}
    fits = python_run(code, **env, CELERY_VISIBILITY_TIMEOUT_S="1261")
    assert fits.returncode == 0 and fits.stdout.strip() == "1261", fits.stderr
    short = python_run(code, **env, CELERY_VISIBILITY_TIMEOUT_S="1200")
    assert short.returncode != 0 and "CELERY_VISIBILITY_TIMEOUT_S must be more than" in short.stderr
    # Shorter limits allow a shorter timeout (what bench/chaos.py runs with).
    quick = python_run(
        code,
        **env,
        GPUPOOL_TASK_TIME_LIMIT_S="60",
        GPUPOOL_LONG_TASK_TIME_LIMIT_S="60",
        GPUPOOL_TASK_LONGEST_COUNTDOWN_S="30",
        CELERY_VISIBILITY_TIMEOUT_S=None,
    )
    assert quick.returncode == 0 and quick.stdout.strip() == "150", quick.stderr


@pytest.mark.django_db(transaction=True)  # the probe is another process: it must see committed rows
def test_the_liveness_probe_reads_when_beat_last_saved_an_entry():
    from django.db import connection

    from tests.conftest import postgres_only, python_run

    postgres_only("the probe's process reads the test database by URL")
    db = connection.settings_dict
    url = f"postgres://{db['USER']}@{db['HOST']}:{db['PORT'] or 5432}/{db['NAME']}"
    beat_schedule_sync(app=app)
    PeriodicTask.objects.update(last_run_at=datetime.now(UTC) - timedelta(minutes=30))
    probe = "import sys; from portal.beat_probe import main; sys.exit(main(['600']))"
    stale = python_run(probe, DATABASE_URL=url)
    assert stale.returncode == 1, stale.stderr  # beat has saved nothing for 30 minutes
    PeriodicTask.objects.filter(name="nodes-expire-commands").update(last_run_at=datetime.now(UTC))
    live = python_run(probe, DATABASE_URL=url)
    assert live.returncode == 0, live.stderr
