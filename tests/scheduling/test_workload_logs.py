"""Log lines about one workload carry its ``workload_id`` (JSON logs), from the services that
handle one workload: submission, stop, preemption and the agent's reports."""

from __future__ import annotations

import logging

from portal.actors import Actor
from scheduling.models import WorkloadState
from scheduling.services import lifecycle
from scheduling.services.lifecycle import workload_on_exited, workload_preempt, workload_stop
from tests.portal.test_logging import json_log
from tests.scheduling.conftest import reload


def about(lines, workload_id):
    return [line for line in lines() if line.get("workload_id") == workload_id]


def test_submit_and_stop_log_json_lines_with_the_workload_id(tenant, make_node, submit, monkeypatch):
    make_node()
    with json_log() as lines:
        w = submit(tenant)
    (submitted,) = [line for line in about(lines, w.pk) if line["logger"] == "scheduling.services.submission"]
    assert submitted["message"] == f"job {w.pk} submitted ({w.plan}, {w.gpu_count} GPU(s))"

    # Anything logged while the service works on the workload carries its id, whoever logs it.
    original = lifecycle.audit_record

    def audit_and_log(**kwargs):
        logging.getLogger("tests.somewhere").warning("auditing")
        return original(**kwargs)

    monkeypatch.setattr(lifecycle, "audit_record", audit_and_log)
    with json_log() as lines:
        workload_stop(workload=w, actor=Actor.system())
    mine = about(lines, w.pk)
    assert {"scheduling.services.states", "tests.somewhere"} <= {line["logger"] for line in mine}
    (transition,) = [line for line in mine if line["logger"] == "scheduling.services.states"]
    assert transition["message"] == f"job {w.pk}: pending -> stopped (stopped_by_user)"
    assert transition["level"] == "INFO"
    # Bound for the call only: a line after it has no workload_id.
    with json_log() as lines:
        logging.getLogger("tests.somewhere").warning("after")
    assert "workload_id" not in lines()[0]


def test_preempt_and_the_agents_reports_log_with_the_workload_id(tenant, make_node, submit, cycle):
    node = make_node()
    w = submit(tenant)
    cycle()
    assert reload(w).state == WorkloadState.SCHEDULED
    with json_log() as lines:
        workload_preempt(workload=w, reason="spot_price")
        workload_on_exited(node_id=node.pk, workload_id=str(w.pk), state="preempted", exit_code=None)
    messages = [
        line["message"] for line in about(lines, w.pk) if line["logger"] == "scheduling.services.states"
    ]
    assert messages == [
        f"job {w.pk}: scheduled -> preempted (spot_price)",
        f"job {w.pk}: preempted -> queued (preempted)",
    ]
