"""The rules of :mod:`afm_http._browser` (issue 31, case 1), without a server."""

from __future__ import annotations

from typing import Any

import pytest

from afm_http._browser import BrowserPolicy, host_name, is_json_media_type, refusal

CHAT = "/v1/chat/completions"


@pytest.mark.parametrize(("header", "name"), [
    ("localhost:9999", "localhost"), ("[::1]:80", "::1"), ("[::1]", "::1"), ("EXAMPLE.com.", "example.com"),
    ("a:b:c", "a:b:c"), ("", ""), ("  x  ", "x")])
def test_host_name(header: str, name: str) -> None:
    assert host_name(header) == name


def test_json_media_types() -> None:
    assert is_json_media_type("application/json") and is_json_media_type("application/ld+json; x=1")
    for bad in (None, "", "json", "text/plain", "application/json5", "text/x+json", "/+json"):
        assert not is_json_media_type(bad), bad


def test_refusal_rules() -> None:
    open_ = BrowserPolicy(listen_hosts=("myhost.lan",))
    hdr: dict[str, Any] = {"Host": "myhost.lan:9999", "Content-Type": "application/json"}
    assert refusal(open_, method="POST", path=CHAT, headers=hdr, has_body=True) is None
    assert refusal(open_, method="GET", path="/v1/models", headers={"Host": "evil.example"},
                   has_body=False).code == "host_not_allowed"  # type: ignore[union-attr]
    assert refusal(open_, method="POST", path=CHAT, headers={**hdr, "Content-Type": "text/plain",
                                                              "Sec-Fetch-Site": "same-origin"},
                   has_body=True).status == 415  # type: ignore[union-attr]
    assert refusal(open_, method="POST", path=CHAT, headers={**hdr, "Content-Type": "text/plain"},
                   has_body=True).status == 415  # type: ignore[union-attr]  # a command line's too
    assert refusal(keyed := BrowserPolicy(keyed=True), method="POST", path=CHAT,
                   headers={**hdr, "Content-Type": "text/plain"}, has_body=True) is None  # with a key, as before
    assert refusal(open_, method="POST", path=CHAT, headers={**hdr, "Content-Type": "text/plain"},
                   has_body=False) is None
    keyed = BrowserPolicy(keyed=True)
    assert refusal(keyed, method="POST", path=CHAT, headers={"Host": "evil", "Origin": "http://evil"},
                   has_body=True) is None
    assert refusal(keyed, method="POST", path="/admin/drain",
                   headers={"Host": "h:1", "Origin": "http://h:1"}, has_body=False) is None
    assert refusal(keyed, method="POST", path="/admin/drain",
                   headers={"Host": "h:1", "Origin": "http://h:2"}, has_body=False) is not None
    assert refusal(keyed, method="POST", path="/admin/drain",
                   headers={"Host": "h", "Origin": "http://h:80"}, has_body=False) is None
