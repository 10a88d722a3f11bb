"""The event types a webhook endpoint may ask for, each with what it means.

Every one is a tenant's live event (``portal.events.publish``) under the same name, so the browser
and the webhooks see the same happenings; ``webhooks.services.events`` records the ones named here.
"""

from __future__ import annotations

ALL = "*"

EVENT_TYPES: dict[str, str] = {
    "workload.state": "A workload (instance or job) changed state: from, to, reason and message.",
    "workload.preemption_notice": "A workload is being preempted: it is stopped after notice_s seconds.",
    "gang.completed": "A gang (one job across several nodes) ended: succeeded, failed or stopped.",
    "array.completed": "An array job ended (every task ended, or it was stopped): its state and task count.",
    "invoice.finalized": "An invoice was finalized: its total and due date.",
    "invoice.paid": "An invoice was paid.",
    "invoice.overdue": "An invoice is past its due date (the team is warned, or suspended past the grace).",
    "budget.alert": "The month's cost reached a threshold of the team's budget.",
    "volume.full": "A volume's measured use reached its size.",
}
