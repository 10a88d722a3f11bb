"""``/webhooks/stripe/``: Stripe's deliveries. The view only reads the body and the signature
header; verification, storing and processing are ``metering.services.payments``."""

from __future__ import annotations

from django.http import JsonResponse
from django.urls import path
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from metering.services.payments import WebhookFailed, WebhookRejected, stripe_webhook_receive


@csrf_exempt
@require_POST
def stripe_webhook(request):
    try:
        stored = stripe_webhook_receive(
            payload=request.body, signature=request.headers.get("Stripe-Signature", "")
        )
    except (WebhookRejected, WebhookFailed) as e:
        return JsonResponse({"error": e.as_dict()}, status=e.status_code)
    if stored is None:
        return JsonResponse({"received": True, "duplicate": True})
    return JsonResponse({"received": True, "result": stored.result})


urlpatterns = [path("", stripe_webhook, name="stripe-webhook")]
