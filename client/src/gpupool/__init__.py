"""gpupool's Python client (``gpupool.client``) and command line (``gpupool``)."""

from gpupool.client import AsyncClient, Client
from gpupool.errors import ApiError, ConnectionFailed, GpupoolError, WebhookSignatureError

__all__ = [
    "ApiError",
    "AsyncClient",
    "Client",
    "ConnectionFailed",
    "GpupoolError",
    "WebhookSignatureError",
]
