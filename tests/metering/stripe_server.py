"""A local stand-in for api.stripe.com: answers the endpoints the Stripe provider and the webhook
handler call with JSON shaped like Stripe's, replays a response for a repeated Idempotency-Key (as
Stripe does), and records every request (method, path, headers, form-encoded body)."""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    form: dict[str, list[str]]

    def one(self, key: str) -> str:
        return self.form[key][0]


@dataclass
class StripeState:
    requests: list[Request] = field(default_factory=list)
    invoices: dict[str, dict] = field(default_factory=dict)
    customers: dict[str, dict] = field(default_factory=dict)
    items: dict[str, dict] = field(default_factory=dict)
    charges: dict[str, dict] = field(default_factory=dict)
    disputes: dict[str, dict] = field(default_factory=dict)
    invoice_payments: dict[str, dict] = field(default_factory=dict)
    by_key: dict[str, tuple[int, dict]] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    # (method, path prefix) -> list of (status, error body) answered once each, before the real answer
    failures: dict[tuple[str, str], list[tuple[int, dict]]] = field(default_factory=dict)
    ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    request_ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    def posts(self, prefix: str) -> list[Request]:
        return [r for r in self.requests if r.method == "POST" and r.path.startswith(prefix)]

    def pay(self, stripe_id: str, *, at: int = 1712700000, amount: int | None = None) -> dict:
        """The invoice paid by a card: a PaymentIntent, its charge and the invoice payment."""
        inv = self.invoices[stripe_id]
        paid = inv["amount_due"] if amount is None else amount
        inv.update(status="paid", amount_paid=paid, attempt_count=inv["attempt_count"] + 1)
        inv["status_transitions"]["paid_at"] = at
        n = next(self.ids)
        charge = {
            "id": f"ch_test{n}",
            "object": "charge",
            "amount": paid,
            "amount_refunded": 0,
            "currency": inv["currency"],
            "customer": inv["customer"],
            "payment_intent": f"pi_test{n}",
            "refunded": False,
            "disputed": False,
            "status": "succeeded",
        }
        self.charges[charge["id"]] = charge
        payment = {
            "id": f"inpay_test{n}",
            "object": "invoice_payment",
            "invoice": stripe_id,
            "amount_paid": paid,
            "currency": inv["currency"],
            "payment": {"type": "payment_intent", "payment_intent": charge["payment_intent"]},
            "status": "paid",
        }
        self.invoice_payments[payment["id"]] = payment
        return charge

    def refund(self, charge_id: str, amount: int) -> dict:
        charge = self.charges[charge_id]
        charge["amount_refunded"] += amount
        charge["refunded"] = charge["amount_refunded"] >= charge["amount"]
        return charge

    def dispute(self, charge_id: str, status: str = "needs_response", dispute_id: str | None = None) -> dict:
        charge = self.charges[charge_id]
        charge["disputed"] = True
        dispute_id = dispute_id or f"dp_test{next(self.ids)}"
        dispute = self.disputes.setdefault(
            dispute_id,
            {
                "id": dispute_id,
                "object": "dispute",
                "charge": charge_id,
                "payment_intent": charge["payment_intent"],
                "amount": charge["amount"],
                "currency": charge["currency"],
                "reason": "fraudulent",
            },
        )
        dispute["status"] = status
        return dispute

    def fail_next(self, method: str, prefix: str, status: int = 400, code: str = "resource_missing"):
        body = {"error": {"type": "invalid_request_error", "code": code, "message": f"test failure {code}"}}
        self.failures.setdefault((method, prefix), []).append((status, body))


def _invoice(state: StripeState, form) -> dict:
    n = next(state.ids)
    inv = {
        "id": f"in_test{n}",
        "object": "invoice",
        "customer": form["customer"][0],
        "currency": form["currency"][0],
        "status": "draft",
        "collection_method": form.get("collection_method", ["charge_automatically"])[0],
        "auto_advance": form.get("auto_advance", ["false"])[0] == "true",
        "metadata": {k[9:-1]: v[0] for k, v in form.items() if k.startswith("metadata[")},
        "amount_due": 0,
        "amount_paid": 0,
        "attempt_count": 0,
        "livemode": False,
        "created": int(time.time()),
        "status_transitions": {"finalized_at": None, "paid_at": None},
    }
    state.invoices[inv["id"]] = inv
    return inv


def _error(code: str, message: str) -> dict:
    return {"error": {"type": "invalid_request_error", "code": code, "message": message}}


def _page(found: list[dict], form, url: str) -> dict:
    """A list answer paged as Stripe pages (``limit``, ``starting_after``)."""
    limit = int(form.get("limit", ["10"])[0])
    after = form.get("starting_after", [None])[0]
    ids = [f["id"] for f in found]
    start = ids.index(after) + 1 if after in ids else 0
    page = found[start : start + limit]
    return {"object": "list", "url": url, "data": page, "has_more": start + limit < len(found)}


class _Handler(BaseHTTPRequestHandler):
    state: StripeState

    def log_message(self, *args):  # quiet
        pass

    def _reply(self, status: int, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("Request-Id", f"req_{next(self.state.request_ids)}")
        self.end_headers()
        self.wfile.write(raw)

    def _handle(self, method: str) -> None:
        st = self.state
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length).decode() if length else ""
        url = urlsplit(self.path)
        form = parse_qs(raw or url.query, keep_blank_values=True)
        st.requests.append(Request(method, url.path, dict(self.headers.items()), form))
        for (m, prefix), queue in st.failures.items():
            if m == method and url.path.startswith(prefix) and queue:
                status, body = queue.pop(0)
                return self._reply(status, body)
        key = self.headers.get("Idempotency-Key")
        if method == "POST" and key and key in st.by_key:
            return self._reply(*st.by_key[key])
        status, body = self._route(method, url.path, form)
        if method == "POST" and key:
            st.by_key[key] = (status, body)
        return self._reply(status, body)

    def _route(self, method: str, path: str, form) -> tuple[int, dict]:
        st = self.state
        parts = path.strip("/").split("/")
        if method == "POST" and path == "/v1/customers":
            cus = {
                "id": f"cus_test{next(st.ids)}",
                "object": "customer",
                "name": form["name"][0],
                "email": form["email"][0],
                "metadata": {k[9:-1]: v[0] for k, v in form.items() if k.startswith("metadata[")},
            }
            st.customers[cus["id"]] = cus
            return 200, cus
        if method == "POST" and path == "/v1/invoices":
            return 200, _invoice(st, form)
        if method == "POST" and path == "/v1/invoiceitems":
            inv = st.invoices[form["invoice"][0]]
            item = {
                "id": f"ii_test{next(st.ids)}",
                "object": "invoiceitem",
                "invoice": inv["id"],
                "amount": int(form["amount"][0]),
                "currency": form["currency"][0],
                "description": form["description"][0],
            }
            st.items[item["id"]] = item
            inv["amount_due"] += item["amount"]
            return 200, item
        if (
            method == "POST"
            and len(parts) == 4
            and parts[:2] == ["v1", "invoices"]
            and parts[3] == "finalize"
        ):
            inv = st.invoices[parts[2]]
            inv["status"] = "open"
            inv["status_transitions"]["finalized_at"] = int(time.time())
            return 200, inv
        if method == "POST" and len(parts) == 4 and parts[:2] == ["v1", "invoices"] and parts[3] == "void":
            inv = st.invoices.get(parts[2])
            if inv is not None and inv["status"] in ("open", "uncollectible"):
                inv["status"] = "void"
                inv["status_transitions"]["voided_at"] = int(time.time())
                return 200, inv
            if inv is not None:
                return 400, _error(
                    "invoice_not_open", f"You can only void an open invoice, not {inv['status']}."
                )
        if method == "DELETE" and len(parts) == 3 and parts[1] == "invoices":
            inv = st.invoices.get(parts[2])
            if inv is not None and inv["status"] == "draft":
                del st.invoices[parts[2]]
                st.deleted.append(parts[2])
                return 200, {"id": parts[2], "object": "invoice", "deleted": True}
            if inv is not None:
                return 400, _error("invoice_not_editable", "You can only delete draft invoices.")
        if method == "GET" and path == "/v1/invoices":
            found = [i for i in st.invoices.values() if i["customer"] == form.get("customer", [None])[0]]
            return 200, _page(found, form, "/v1/invoices")
        if method == "GET" and path == "/v1/invoice_payments":
            intent = form.get("payment[payment_intent]", [None])[0]
            found = [p for p in st.invoice_payments.values() if p["payment"]["payment_intent"] == intent]
            return 200, _page(found, form, "/v1/invoice_payments")
        if method == "GET" and len(parts) == 3:
            table = {
                "invoices": st.invoices,
                "customers": st.customers,
                "charges": st.charges,
                "disputes": st.disputes,
            }.get(parts[1], {})
            found = table.get(parts[2])
            if found is not None:
                return 200, found
        return 404, {
            "error": {
                "type": "invalid_request_error",
                "code": "resource_missing",
                "message": f"No such {path}",
            }
        }

    def do_GET(self):
        self._handle("GET")

    def do_DELETE(self):
        self._handle("DELETE")

    def do_POST(self):
        self._handle("POST")


class StripeServer:
    def __init__(self) -> None:
        self.state = StripeState()
        handler = type("Handler", (_Handler,), {"state": self.state})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> StripeServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
