"""Metering's reads, split by what they serve:

- ``shared``: what the tenant API, the admission checks, the price provider and the invoice
  documents share (the month's cost so far, the hourly estimate, an invoice as CSV)
- ``billing_pages``: the tenant's billing pages (a month of usage by UTC day and GPU model, credit
  balances, reservation quotes)
"""
