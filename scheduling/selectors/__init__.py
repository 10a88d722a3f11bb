"""Scheduling's reads, split by what they serve:

- ``shared``: what the tenant API, the web UI and the services share (quota usage, workloads and
  their events and placement, reservations, GPU availability and the catalog)
- ``staff_queue``: the staff queue page (pending demand, why it waits, fair-share standing)
- ``staff_quotas``: the staff quota pages (many tenants' limits beside their use, the audit trail)
"""
