"""Scheduling's write side, one module per domain: ``states`` (the state machine), ``submission``
(validation, quotas, admission), ``allocations``, ``cycle`` (the scheduling cycle), ``lifecycle``
(what the fleet reports: started, exited, node down, GPU unhealthy; the reconciler), ``reservations``
and ``warm_pools``."""
