"""Scheduling's write side, one module per domain: ``states`` (the state machine), ``submission``
(validation, quotas, admission), ``allocations``, ``cycle`` (the scheduling cycle), ``lifecycle``
(what the fleet reports: started, exited, node down, GPU unhealthy; the reconciler; preemption, with
``workload_preempt`` for other apps), ``reservations`` and ``warm_pools``."""

from scheduling.services.lifecycle import workload_preempt

__all__ = ["workload_preempt"]
