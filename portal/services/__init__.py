"""Writes for tenancy, one module per domain. Every service is keyword-only, runs in one transaction
and records an AuditEvent for a change a person (or a token) made.

- ``audit``: ``audit_record``, the audit log every app writes to
- ``roles``: what an actor's role in a tenant lets it grant (shared by members, invitations, tokens)
- ``accounts``: users: get or create, account setup mail, password and profile checks
- ``tenants``: create a tenant with its owner, set its status (active, grace, suspended)
- ``members``: change a member's role, remove a member (and revoke what they no longer may hold)
- ``invitations``: invite, look up, accept (also by signing up), revoke, purge expired
- ``tokens``: API tokens: scopes, create, revoke, authenticate, touch
"""
