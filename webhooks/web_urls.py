"""The webhooks pages (mounted at the site root)."""

from django.urls import path

from webhooks import views

app_name = "webhooks"
urlpatterns = [
    path("webhooks/", views.WebhooksView.as_view(), name="list"),
    path("webhooks/<int:pk>/", views.WebhookDetailView.as_view(), name="detail"),
    path("webhooks/deliveries/<int:pk>/redeliver/", views.RedeliverView.as_view(), name="redeliver"),
]
