"""Metering's web pages and the staff finance API, mounted at the site root by the project URLconf."""

from django.urls import path

from metering import finance_api, panels, views

app_name = "metering"
urlpatterns = [
    path("panels/budget/", panels.BudgetPanel.as_view(), name="panel-budget"),
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
