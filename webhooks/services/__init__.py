"""Webhook services: endpoints (``endpoints``), recording events (``events``) and delivering them
(``deliveries``)."""
