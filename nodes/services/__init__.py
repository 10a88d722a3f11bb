"""Writes for the fleet, one module per domain:

- ``registration``: bootstrap tokens, register (token -> credential), credential checks, GPU matching
- ``ingest``: heartbeats and telemetry (the hot path)
- ``commands``: NodeCommand enqueue / deliver / report / expire
- ``health``: silence reconciler, GPU isolation, staff node and GPU actions
- ``rollouts``: rolling upgrades (campaigns, batches, drain, upgrade, GPU check, return)
- ``telemetry``: retention
- ``wakeup``: waking long polls (Redis pub/sub when REDIS_URL is set)
"""
