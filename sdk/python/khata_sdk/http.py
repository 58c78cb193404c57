"""Requests to named HTTP providers, once per idempotency key. The queue
needs the ``http`` grant for the provider.

A request names a provider from jobs.toml (``[http.NAME]``), never a URL:
the daemon joins its base URL and the path, adds its configured headers, an
idempotency header carrying the key where the provider has one, and a
``Khata-Fencing-Token`` header. The response to each key is recorded:
sending again with the same key and request replays it (``replayed`` is
true). A response of any status is recorded, so :func:`send` returns a 4xx
or 5xx too; check :meth:`Response.is_success`::

    from khata_sdk import Fail, http

    request = http.post("payments", "/v1/charges").json({"amount": 1200})
    response = http.send("order-charge-42", request)
    if not response.is_success():
        raise Fail(f"charge refused: {response.status}")
    charge = response.json()
"""

import json
from dataclasses import dataclass, field
from typing import Optional

from . import _host
from .errors import Fail


@dataclass
class Request:
    """An HTTP request to a named provider: build one with :func:`request`
    or the method functions (:func:`get`, :func:`post`, ...) and the
    methods below, each returning the request.

    >>> r = post("payments", "/v1/charges").header("x-trace", "1").json({"amount": 5})
    >>> r.body
    b'{"amount":5}'
    """

    provider: str
    method: str
    path: str
    headers: list = field(default_factory=list)
    body: Optional[bytes] = None

    def header(self, name: str, value: str) -> "Request":
        """Adds a header."""
        self.headers.append((name, value))
        return self

    def with_body(self, body) -> "Request":
        """Sets the body (``bytes``, or ``str`` sent as UTF-8)."""
        self.body = body.encode() if isinstance(body, str) else bytes(body)
        return self

    def json(self, value) -> "Request":
        """Sets the body to ``value`` as compact JSON, and
        ``content-type: application/json`` unless a content type is set."""
        self.body = json.dumps(value, separators=(",", ":")).encode()
        if not any(name.lower() == "content-type" for name, _ in self.headers):
            self.headers.append(("content-type", "application/json"))
        return self


@dataclass
class Response:
    """The provider's response, as received or as replayed from the ledger."""

    status: int
    headers: list
    body: bytes
    replayed: bool

    def is_success(self) -> bool:
        """True for a 2xx status."""
        return 200 <= self.status < 300

    def header(self, name: str):
        """The first value of header ``name`` (ignoring case), or ``None``."""
        for n, v in self.headers:
            if n.lower() == name.lower():
                return v
        return None

    def text(self) -> str:
        """The body as UTF-8 text; a body that is not UTF-8 is
        :class:`~khata_sdk.Fail`."""
        try:
            return self.body.decode()
        except UnicodeDecodeError as e:
            raise Fail(f"the response body is not UTF-8: {e}") from None

    def json(self):
        """The body parsed as JSON; a body that does not parse is
        :class:`~khata_sdk.Fail`."""
        try:
            return json.loads(self.body)
        except ValueError as e:
            raise Fail(f"the response body is not the expected JSON: {e}") from None


def request(provider: str, method: str, path: str) -> Request:
    """A request with any method to ``path`` on ``provider``."""
    return Request(provider, method, path)


def get(provider: str, path: str) -> Request:
    """A ``GET`` request to ``path`` on ``provider``."""
    return request(provider, "GET", path)


def post(provider: str, path: str) -> Request:
    """A ``POST`` request to ``path`` on ``provider``."""
    return request(provider, "POST", path)


def put(provider: str, path: str) -> Request:
    """A ``PUT`` request to ``path`` on ``provider``."""
    return request(provider, "PUT", path)


def patch(provider: str, path: str) -> Request:
    """A ``PATCH`` request to ``path`` on ``provider``."""
    return request(provider, "PATCH", path)


def delete(provider: str, path: str) -> Request:
    """A ``DELETE`` request to ``path`` on ``provider``."""
    return request(provider, "DELETE", path)


def send(key: str, request: Request) -> Response:
    """Sends ``request`` once for ``key``; raises
    :class:`~khata_sdk.EffectError` when the host refuses.

    >>> send("order-charge-42", post("payments", "/v1/charges").json({}))  # doctest: +SKIP
    """
    wit = _host.interface("http")
    raw = wit.Request(
        provider=request.provider,
        method=request.method,
        path=request.path,
        headers=list(request.headers),
        body=request.body,
    )
    r = _host.call("http", "send", key, raw)
    return Response(r.status, list(r.headers), bytes(r.body), r.replayed)
