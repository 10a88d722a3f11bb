"""Job arrays, work queues and dependencies through the services, the cycle and the API."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from nodes.models import CommandKind, NodeCommand
from nodes.signals import workload_exited
from portal.actors import Actor
from portal.errors import ValidationFailed
from scheduling.models import WorkItem, WorkItemState, Workload
from scheduling.models import WorkloadState as S
from scheduling.selectors.shared import quota_usage
from scheduling.services.env import start_payload_for_node
from scheduling.services.lifecycle import workload_stop
from scheduling.services.work import WorkTokenInvalid, work_done, work_next, work_task_for_token
from tests.portal.conftest import signed_in  # noqa: F401  (fixture)
from tests.scheduling.conftest import reload, report_start

pytestmark = pytest.mark.django_db


def _exit(node, w: Workload, code: int = 0) -> None:
    workload_exited.send(
        sender=type(node),
        node=node,
        workload_id=str(w.pk),
        state="exited" if code == 0 else "failed",
        exit_code=code,
        finished_at=timezone.now(),
        message="",
    )


def tasks(parent: Workload) -> list[Workload]:
    return list(Workload.objects.filter(array_parent=parent).order_by("array_index"))


def test_an_array_runs_its_tasks_parallelism_at_a_time_each_with_its_index(tenant, make_node, submit, cycle):
    node = make_node(gpus=8)
    parent = submit(tenant, name="sweep", array={"count": 5, "parallelism": 2}, max_retries=1)
    assert quota_usage(tenant=tenant).workloads == 0  # the array job itself is never counted
    cycle()
    made = tasks(parent)
    assert [t.array_index for t in made] == [0, 1] and [t.state for t in made] == [S.SCHEDULED] * 2
    assert made[0].name == "sweep[0]" and made[0].max_retries == 1 and made[0].image == parent.image
    assert quota_usage(tenant=tenant).workloads == 2
    payload = report_start(made[0], node).payload
    assert payload["platform_env"] == {"GPUPOOL_ARRAY_INDEX": "0", "GPUPOOL_ARRAY_COUNT": "5"}
    assert payload["env"] == {}  # the tenant's env stays the tenant's
    cycle()
    assert reload(parent).state == S.RUNNING
    assert len(tasks(parent)) == 2  # parallelism: no third while two are unfinished

    # Task 0 fails once: retried on its own (its own retries), the array goes on.
    _exit(node, made[0], code=1)
    assert reload(made[0]).state == S.QUEUED and reload(made[0]).retries == 1
    cycle()
    assert len(tasks(parent)) == 2
    for t in tasks(parent):
        if reload(t).state == S.SCHEDULED:
            report_start(t, node)
    for t in tasks(parent):
        _exit(node, t)
    cycle()
    assert [t.array_index for t in tasks(parent)] == [0, 1, 2, 3]
    for t in tasks(parent)[2:]:
        report_start(t, node)
        _exit(node, t)
    cycle()
    last = tasks(parent)[4]
    report_start(last, node)
    _exit(node, last, code=0)
    cycle()
    parent = reload(parent)
    assert parent.state == S.SUCCEEDED and parent.state_reason == "All 5 task(s) succeeded."
    assert [t.state for t in tasks(parent)] == [S.SUCCEEDED] * 5


def test_an_array_with_a_failed_task_fails_and_says_how_many(tenant, make_node, submit, cycle):
    node = make_node(gpus=8)
    parent = submit(tenant, array={"count": 2, "parallelism": 2})
    cycle()
    a, b = tasks(parent)
    report_start(a, node), report_start(b, node)
    _exit(node, a, code=0)
    _exit(node, b, code=3)
    cycle()
    parent = reload(parent)
    assert parent.state == S.FAILED and parent.state_reason == "1 of 2 task(s) failed."


def test_stop_stops_every_task_and_makes_no_more(tenant, make_node, submit, cycle):
    node = make_node(gpus=2)
    parent = submit(tenant, array={"count": 10, "parallelism": 4})
    cycle()
    made = tasks(parent)
    assert len(made) == 4 and sum(t.state == S.SCHEDULED for t in made) == 2  # 2 GPUs
    report_start(made[0], node)
    workload_stop(workload=parent, actor=Actor.system())
    assert reload(parent).state == S.STOPPED
    states = {t.array_index: t.state for t in tasks(parent)}
    assert states[0] == S.STOPPING and sorted(states.values()).count(S.STOPPED) == 2
    assert NodeCommand.objects.filter(
        kind=CommandKind.STOP_WORKLOAD, payload__workload_id=str(made[0].pk)
    ).exists()
    cycle()
    assert len(tasks(parent)) == 4


def test_array_api_tasks_summary_and_refusals(tenant, make_tenant, make_token, api, make_node):
    make_node(gpus=8)
    client = api(make_token(tenant))
    spec = {"image": "ghcr.io/acme/render:1", "command": ["render"], "gpu_models": ["H100"]}
    r = client.post(
        "/api/v1/jobs/", {**spec, "array": {"count": 3, "parallelism": 2}}, content_type="application/json"
    )
    assert r.status_code == 201, r.content
    job = r.json()
    assert job["array"]["count"] == 3 and job["array"]["states"]["pending"] == 3 and job["array"]["made"] == 0
    from scheduling.services.cycle import scheduling_cycle_run

    scheduling_cycle_run()
    r = client.get(f"/api/v1/jobs/{job['id']}/tasks/")
    assert r.status_code == 200
    listed = r.json()["results"]
    assert sorted(t["array_index"] for t in listed) == [0, 1] and {t["array_parent"] for t in listed} == {
        job["id"]
    }
    summary = client.get(f"/api/v1/jobs/{job['id']}/").json()["array"]
    assert summary["made"] == 2 and summary["states"]["scheduled"] == 2 and summary["states"]["pending"] == 1

    # Another tenant's array: 404, as the owner's 200 above.
    other = api(make_token(make_tenant("other")))
    assert other.get(f"/api/v1/jobs/{job['id']}/tasks/").status_code == 404
    # Refusals name the field.
    for bad in (
        {"count": 0},
        {"count": "3"},
        {"parallelism": 2},
        {"count": 2, "extra": 1},
        {"count": 2, "work": {"first": 5, "last": 1}},
        {"count": 20001},
    ):
        r = client.post("/api/v1/jobs/", {**spec, "array": bad}, content_type="application/json")
        assert r.status_code == 400 and "array" in r.json()["error"]["fields"], (bad, r.content)
    r = client.post(
        "/api/v1/jobs/",
        {**spec, "gang": True, "gpu_count": 8, "array": {"count": 2}},
        content_type="application/json",
    )
    assert r.status_code == 400 and "array" in r.json()["error"]["fields"]
    inst = {"image": "ghcr.io/acme/nb:1", "gpu_models": ["H100"], "array": {"count": 2}}
    r = client.post("/api/v1/instances/", inst, content_type="application/json")
    assert r.status_code == 400 and "array" in r.json()["error"]["fields"]
    assert client.get(f"/api/v1/jobs/{listed[0]['id']}/tasks/").status_code == 404  # a task is no array
    # depends_on over HTTP: another tenant's job reads exactly as an unknown id.
    foreign = other.post("/api/v1/jobs/", spec, content_type="application/json").json()["id"]
    unknown = foreign + 1000
    answers = []
    for job_id in (foreign, unknown):
        r = client.post(
            "/api/v1/jobs/", {**spec, "depends_on": [{"job": job_id}]}, content_type="application/json"
        )
        assert r.status_code == 400
        answers.append(r.json()["error"]["fields"]["depends_on"][0].replace(str(job_id), "ID"))
    assert answers[0] == answers[1] == "No job of yours with id ID."
    r = client.post(
        "/api/v1/jobs/", {**spec, "depends_on": [{"job": job["id"]}]}, content_type="application/json"
    )
    assert r.status_code == 201 and r.json()["depends_on"] == [
        {"job": job["id"], "condition": "succeeded", "state": "pending"}
    ]


def test_dependencies_wait_then_run_or_fail_with_the_reason(tenant, make_tenant, make_node, submit, cycle):
    node = make_node(gpus=8)
    first = submit(tenant)
    second = submit(tenant)
    after_ok = submit(tenant, depends_on=[{"job": first.pk, "condition": "succeeded"}])
    after_any = submit(tenant, depends_on=[{"job": second.pk, "condition": "finished"}])
    never = submit(tenant, depends_on=[{"job": second.pk}])  # succeeded by default
    cycle()
    for w in (after_ok, after_any, never):
        w = reload(w)
        assert w.state == S.PENDING and w.pending_reason == "dependency"
    assert reload(after_ok).pending_message == f"Waiting for job {first.pk} to succeed (pending)."
    report_start(first, node), report_start(second, node)
    _exit(node, first, code=0)
    _exit(node, second, code=1)
    cycle()
    assert reload(after_ok).state == S.SCHEDULED
    assert reload(after_any).state == S.SCHEDULED
    never = reload(never)
    assert never.state == S.FAILED
    assert never.state_reason == f"Dependency never satisfied: job {second.pk} failed (it had to succeed)."

    other = make_tenant("other")
    foreign = submit(other)
    for bad in (
        [{"job": foreign.pk}],  # another tenant's: as unknown
        [{"job": 10**9}],
        [{"job": first.pk}, {"job": first.pk}],
        [{"job": first.pk, "condition": "maybe"}],
        [{"job": Workload.objects.order_by("-pk").first().pk + 1}],  # the next id: how a cycle is spelt
        "x",
    ):
        with pytest.raises(ValidationFailed) as err:
            submit(tenant, depends_on=bad)
        assert "depends_on" in err.value.fields
    with pytest.raises(ValidationFailed) as err:
        submit(tenant, depends_on=[{"job": foreign.pk}])
    assert err.value.fields["depends_on"] == [f"No job of yours with id {foreign.pk}."]


def test_an_array_waits_for_its_dependency(tenant, make_node, submit, cycle, make_token, api):
    node = make_node(gpus=8)
    first = submit(tenant)
    parent = submit(tenant, array={"count": 2}, depends_on=[{"job": first.pk, "condition": "finished"}])
    cycle()
    assert tasks(parent) == []
    body = api(make_token(tenant)).get(f"/api/v1/jobs/{parent.pk}/").json()
    assert body["pending"]["reason"] == "dependency" and body["depends_on"] == [
        {"job": first.pk, "condition": "finished", "state": "scheduled"}
    ]
    report_start(first, node)
    _exit(node, first, code=2)
    cycle()
    assert len(tasks(parent)) == 2


def test_work_queue_leases_returns_items_of_a_dead_worker_and_finishes_each_once(
    tenant, make_node, submit, cycle
):
    node = make_node(gpus=8)
    parent = submit(
        tenant,
        array={"parallelism": 2, "work": {"first": 1, "last": 10, "chunk": 3, "lease_s": 60}},
        max_retries=1,
    )
    assert [(i.first, i.last) for i in WorkItem.objects.filter(job=parent).order_by("index")] == [
        (1, 3), (4, 6), (7, 9), (10, 10)
    ]  # fmt: skip
    cycle()
    a, b = tasks(parent)
    stored = report_start(a, node).payload
    report_start(b, node)
    assert "GPUPOOL_WORK_TOKEN" not in stored["platform_env"]  # never stored with the command
    wire = start_payload_for_node(stored)
    token = wire["platform_env"]["GPUPOOL_WORK_TOKEN"]
    assert wire["platform_env"]["GPUPOOL_WORK_URL"].endswith("/api/v1/work/")
    worker_a = work_task_for_token(token)
    assert worker_a.pk == a.pk
    with pytest.raises(WorkTokenInvalid):
        work_task_for_token(token[:-2] + "xx")
    now = timezone.now()
    item0, _ = work_next(task=worker_a, now=now)
    item1, _ = work_next(task=reload(b), now=now)
    assert (item0.index, item1.index) == (0, 1)
    work_done(task=worker_a, index=0, now=now)
    # Worker a dies holding item 2: its task is requeued (a retry), item 2 goes to b.
    item2, _ = work_next(task=worker_a, now=now)
    assert item2.index == 2
    _exit(node, a, code=137)
    with pytest.raises(WorkTokenInvalid):
        work_task_for_token(token)  # that attempt is over
    again, _ = work_next(task=reload(b), now=now)
    assert again.index == 2 and again.leases == 2
    # A lease that runs out goes to whoever asks next.
    work_done(task=reload(b), index=1, now=now)
    work_done(task=reload(b), index=2, now=now)
    item3, _ = work_next(task=reload(b), now=now)
    assert item3.index == 3
    later = now + timedelta(seconds=61)
    cycle()
    a2 = reload(a)
    report_start(a2, node)
    taken, _ = work_next(task=reload(a2), now=later)
    assert taken.index == 3
    with pytest.raises(Exception) as lost:
        work_done(task=reload(b), index=3, now=later)
    assert getattr(lost.value, "status_code", None) == 409
    work_done(task=reload(a2), index=3, now=later)
    assert work_next(task=reload(b), now=later) == (None, True)
    assert set(WorkItem.objects.filter(job=parent).values_list("state", flat=True)) == {WorkItemState.DONE}
    _exit(node, reload(a2), code=0)
    _exit(node, reload(b), code=0)
    cycle()
    assert reload(parent).state == S.SUCCEEDED


def test_the_job_page_shows_the_tasks_their_summary_and_the_dependencies(
    signed_in,  # noqa: F811
    owner,
    tenant,
    make_node,
    submit,
    cycle,
):
    make_node(gpus=1)
    first = submit(tenant)
    parent = submit(
        tenant,
        name="sweep",
        array={"count": 3, "parallelism": 2},
        depends_on=[{"job": first.pk, "condition": "finished"}],
    )
    client = signed_in(owner, tenant)
    html = client.get(f"/workloads/{parent.pk}/").content.decode()
    assert 'id="array-tasks"' in html and "No task made yet." in html
    assert f'href="/workloads/{first.pk}/"' in html and "finishes" in html  # the dependency
    workload_stop(workload=first, actor=Actor.system())
    cycle()
    html = client.get(f"/workloads/{parent.pk}/").content.decode()
    made = tasks(parent)
    assert len(made) == 2
    for t in made:
        assert f'data-array-task-row="{t.array_index}"' in html and f'href="/workloads/{t.pk}/"' in html
    assert 'data-array-state="scheduled">1 scheduled' in html and 'data-array-state="queued">1 queued' in html
    assert 'data-array-state="pending">1 pending' in html  # the third, not made yet
    task_html = client.get(f"/workloads/{made[0].pk}/").content.decode()
    assert "Task 0 of array job" in task_html and f'href="/workloads/{parent.pk}/"' in task_html


def test_restarting_a_work_queue_array_submits_the_same_array(signed_in, owner, tenant, make_node, submit):  # noqa: F811
    make_node(gpus=8)
    work = {"first": 10, "last": 31, "chunk": 4, "lease_s": 120}
    parent = submit(tenant, array={"parallelism": 3, "work": work})
    workload_stop(workload=parent, actor=Actor.system())
    client = signed_in(owner, tenant)
    assert client.post(f"/workloads/{parent.pk}/restart/").status_code == 302
    new = Workload.objects.filter(array_count__isnull=False).exclude(pk=parent.pk).get()
    assert (new.array_count, new.array_parallelism, new.work_lease_s) == (3, 3, 120)
    items = list(WorkItem.objects.filter(job=new).order_by("index").values_list("first", "last"))
    assert items == list(WorkItem.objects.filter(job=parent).order_by("index").values_list("first", "last"))
    assert items[0] == (10, 13) and items[-1] == (30, 31)


def test_the_agent_takes_only_the_platform_variables_it_knows():
    from nodes.agent.workload_rules import WorkloadRuleError, check_start_payload

    base = {"workload_id": "7", "image": "x:1", "command": ["true"]}
    ok = check_start_payload({**base, "platform_env": {"GPUPOOL_ARRAY_INDEX": "3"}})
    assert ok["platform_env"] == {"GPUPOOL_ARRAY_INDEX": "3"}
    for bad in ({"LD_PRELOAD": "/x.so"}, {"GPUPOOL_ARRAY_INDEX": 3}, {"GPUPOOL_WORK_TOKEN": "a\nb"}, []):
        with pytest.raises(WorkloadRuleError):
            check_start_payload({**base, "platform_env": bad})
    with pytest.raises(WorkloadRuleError):  # and the tenant's env may still not name them
        check_start_payload({**base, "env": {"GPUPOOL_ARRAY_INDEX": "0"}})
