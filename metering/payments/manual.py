"""The manual provider: nothing leaves the portal; finance marks invoices paid (admin action)."""

from __future__ import annotations

from metering.payments import Submission


class ManualProvider:
    name = "manual"

    def collect(self, *, invoice) -> Submission:
        return Submission()

    def lookup(self, *, invoice) -> str:
        return ""

    def void(self, *, invoice) -> str:
        return ""
