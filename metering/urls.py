"""Metering's web pages and the staff finance API, mounted at the site root by the project URLconf."""

from django.urls import path

from metering import finance_api, panels, views, views_billing

app_name = "metering"
urlpatterns = [
    path("panels/budget/", panels.BudgetPanel.as_view(), name="panel-budget"),
    path("panels/alerts/", panels.AlertsPanel.as_view(), name="panel-alerts"),
    # the tenant's invoices
    path("billing/invoices/", views.InvoiceListView.as_view(), name="invoices"),
    path(
        "billing/invoices/<int:pk>/pdf/",
        views.InvoiceDownloadView.as_view(),
        {"fmt": "pdf"},
        name="invoice-pdf",
    ),
    path(
        "billing/invoices/<int:pk>/csv/",
        views.InvoiceDownloadView.as_view(),
        {"fmt": "csv"},
        name="invoice-csv",
    ),
    # usage, reservations and the budget
    path("billing/usage/", views_billing.UsageView.as_view(), name="usage"),
    path("billing/reservations/", views_billing.ReservationsView.as_view(), name="reservations"),
    path(
        "billing/reservations/quote/", views_billing.ReservationQuoteView.as_view(), name="reservation-quote"
    ),
    path(
        "billing/reservations/<int:pk>/cancel/",
        views_billing.ReservationCancelView.as_view(),
        name="reservation-cancel",
    ),
    path("billing/budget/", views_billing.BudgetView.as_view(), name="budget"),
    # staff finance reports
    path("staff/finance/", views.RevenueView.as_view(), name="finance-revenue"),
    path("staff/finance/gpu-hours/", views.GpuHoursView.as_view(), name="finance-gpu-hours"),
    path("staff/finance/receivables/", views.ReceivablesView.as_view(), name="finance-receivables"),
    # the same reports for staff tokens
    path("api/staff/v1/finance/revenue/", finance_api.RevenueApi.as_view(), name="finance-api-revenue"),
    path("api/staff/v1/finance/gpu-hours/", finance_api.GpuHoursApi.as_view(), name="finance-api-gpu-hours"),
    path(
        "api/staff/v1/finance/receivables/",
        finance_api.ReceivablesApi.as_view(),
        name="finance-api-receivables",
    ),
]
