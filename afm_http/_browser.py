"""What a web browser may ask of this server: the checks against cross-site
requests and DNS rebinding (sans-IO: headers in, a refusal or None out).

A server without an API key on 127.0.0.1 is reachable from every page the
machine's browser opens: a page on any origin can send it requests (a
``no-cors`` ``fetch`` needs no CORS permission to *send*, only to read the
answer), and a host name the attacker controls can be re-pointed at
127.0.0.1 (DNS rebinding), making the page same-origin with the server.
Without ``--api-key`` therefore (:func:`refusal`):

* the ``Host`` header must name this server: an IP address (a rebinding
  attack needs a host name), ``localhost`` (or a ``*.localhost`` name), the
  address it was bound to (``--host``), or a name given with
  ``--allowed-host`` (``*``: any); else 403 ``host_not_allowed``;
* a request with an ``Origin`` header (every browser sends one on a
  cross-origin ``POST``, and on every CORS request) must come from the
  server's own origin or one of ``--cors-origin``; else 403
  ``origin_not_allowed``; without one, a ``Sec-Fetch-Site: cross-site``
  header refuses it too;
* a request with a body must say it is JSON (``Content-Type:
  application/json`` or ``*/*+json``): the types a page may send without a
  CORS preflight (``text/plain``, forms) and no type at all (a ``Blob``
  body) get 415 ``unsupported_media_type``, from a browser or not (nothing a
  page cannot forge tells them apart).  ``curl -d`` sends a form type, so a
  command line adds ``-H 'Content-Type: application/json'`` (the error says
  so); the SDKs (OpenAI's, Anthropic's, ``ollama``'s) send it already.

``GET /health`` is exempt (it holds no data, and load balancers' checks send
HTTP/1.0 without a ``Host``).  With a key, a page cannot send it (a browser never adds an
``Authorization`` header on its own, and a page that adds one needs the
key and a CORS preflight ``--cors-origin`` allows), so only the last rule
holds whatever the key: ``/admin/*`` refuses every cross-site request
(another origin, or ``Sec-Fetch-Site`` other than ``same-origin``/``none``),
since draining a replica is never something a page should do.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import urlsplit

__all__ = ["BrowserPolicy", "Refusal", "host_name", "is_json_media_type", "refusal"]

_SAFE_FETCH_SITES = ("same-origin", "none")
"""``Sec-Fetch-Site`` values of a request the page did not make cross-site
(``none``: typed in the address bar, a bookmark)."""


class Headers(Protocol):
    """What :func:`refusal` reads of the request's headers (a dict, or werkzeug's ``Headers``)."""

    def get(self, key: str, /) -> str | None: ...


@dataclass(frozen=True, slots=True)
class BrowserPolicy:
    """What :func:`refusal` checks against (from the server's options)."""

    keyed: bool = False
    """An API key is required (``--api-key``): only the ``/admin/*`` rule applies."""
    cors_origins: Collection[str] = ()
    """``--cors-origin``: origins allowed besides the server's own (``*``: any)."""
    allowed_hosts: Collection[str] = ()
    """``--allowed-host``: host names accepted besides addresses and ``localhost`` (``*``: any)."""
    listen_hosts: Collection[str] = ()
    """The addresses or names the server was bound to (``--host``)."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is refused: its HTTP status, message and error code."""

    status: int
    message: str
    code: str
    type: str = "permission_error"


def refusal(policy: BrowserPolicy, *, method: str, path: str, headers: Headers,
            has_body: bool) -> Refusal | None:
    """None when the request may go on, else why not (see the module docstring)."""
    host = headers.get("Host") or ""
    origin = headers.get("Origin")
    site = (headers.get("Sec-Fetch-Site") or "").strip().lower()
    if path == "/admin" or path.startswith("/admin/"):
        if (origin is not None and not _same_origin(origin, host)) \
                or (origin is None and site and site not in _SAFE_FETCH_SITES):
            return Refusal(403, "the /admin routes refuse cross-site requests (send them from "
                                "a command line, a load balancer or this server's own page)",
                           "cross_site_refused")
    if policy.keyed or path == "/health":
        return None  # (load balancers' health checks send no Host, or their own)
    name = host_name(host)
    if not _host_allowed(name, policy):
        shown = name[:100] or "(none)"
        return Refusal(403, f"the Host header {shown!r} is not an address of this server: "
                            f"start it with --allowed-host {shown} to accept that name, or set "
                            "--api-key", "host_not_allowed")
    if origin is not None:
        if not (_same_origin(origin, host) or "*" in policy.cors_origins
                or origin in policy.cors_origins):
            return Refusal(403, f"requests from the origin {origin[:100]!r} are refused: allow it "
                                "with --cors-origin, or set --api-key", "origin_not_allowed")
    elif site == "cross-site":
        return Refusal(403, "cross-site requests are refused without --api-key",
                       "origin_not_allowed")
    if has_body and method.upper() not in ("GET", "HEAD", "OPTIONS") \
            and not is_json_media_type(headers.get("Content-Type")):
        sent = (headers.get("Content-Type") or "none").split(";", 1)[0].strip()[:60]
        return Refusal(415, f"the request body must be JSON, sent as 'Content-Type: "
                            f"application/json' (this one's type: {sent!r}; curl -d sends a form "
                            "type: add -H 'Content-Type: application/json'), or set --api-key",
                       "unsupported_media_type", type="invalid_request_error")
    return None


def host_name(host: str) -> str:
    """The host part of a ``Host`` header (no port, no IPv6 brackets), lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        return host[1:end] if end > 0 else host
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def is_json_media_type(content_type: str | None) -> bool:
    """``application/json`` or a ``+json`` type (parameters such as ``charset`` aside)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    kind, _, sub = media.partition("/")
    return bool(kind) and (media == "application/json" or (sub.endswith("+json") and kind == "application"))


def _host_allowed(name: str, policy: BrowserPolicy) -> bool:
    if not name:
        return False  # HTTP/1.1 requires a Host; an HTTP/1.0 client without one is no browser,
        # but nothing tells it apart from one: refuse, as the rebinding rule asks
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(name.partition("%")[0])
        return True
    except ValueError:
        pass
    allowed = {h.strip().lower().rstrip(".") for h in (*policy.allowed_hosts, *policy.listen_hosts)}
    return "*" in allowed or name in allowed


def _same_origin(origin: str, host: str) -> bool:
    """Whether ``origin`` (an ``Origin`` header) is the server's own, the one the
    ``Host`` header names (``http`` or ``https``; ports compared as written, the
    scheme's default filled in)."""
    try:
        parts = urlsplit(origin.strip())
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/"):
        return False
    default = 80 if parts.scheme == "http" else 443
    own_host = host_name(host)
    try:
        own_port = urlsplit(f"//{host.strip()}").port or default
    except ValueError:
        return False
    return parts.hostname.rstrip(".") == own_host and (port or default) == own_port
