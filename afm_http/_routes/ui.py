"""``GET /``: a small chat page over the server's own API (``afm serve --no-ui``: off).

The page is three static files shipped in the package (``afm_http/static/``:
``index.html``, ``chat.js``, ``chat.css``, no dependencies): ``/`` is the
HTML, ``/ui/<file>`` the rest.  Everything it shows comes from the public API
it calls from the browser (``GET /v1/models``, ``POST /v1/chat/completions``
streamed, the cancel route), so it needs no route of its own beyond these
files.  They hold no data, so the middleware serves them without the API key
(the page asks for the key and sends it with its API calls).  A strict
Content-Security-Policy allows only these files and same-origin requests.
With ``ServerConfig(ui=False)`` nothing is registered and ``/`` is 404.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files

from quart import Response
from werkzeug.exceptions import NotFound

from .._asgi import AFMQuart

__all__ = ["ASSETS", "register"]

ASSETS = {
    "index.html": "text/html; charset=utf-8",
    "chat.js": "text/javascript; charset=utf-8",
    "chat.css": "text/css; charset=utf-8",
}
"""The page's files (in ``afm_http/static/``) and their content types."""

SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "connect-src 'self'; img-src 'self' data:; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def register(app: AFMQuart) -> None:
    if not app.afm_state.config.ui:
        return
    app.get("/")(ui_page)
    app.get("/ui/<name>")(ui_asset)


@cache
def _read(name: str) -> bytes:
    return (files("afm_http") / "static" / name).read_bytes()


def _asset(name: str) -> Response:
    return Response(_read(name), content_type=ASSETS[name], headers=SECURITY_HEADERS)


async def ui_page() -> Response:
    return _asset("index.html")


async def ui_asset(name: str) -> Response:
    if name not in ASSETS or name == "index.html":
        raise NotFound()  # the envelope every unknown path gets
    return _asset(name)
