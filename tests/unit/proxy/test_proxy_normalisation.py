"""Header names and paths are read in one canonical form before any rule: no spelling gets around a rule.

A header is stripped whatever its casing and whether it says `_` or `-` (servers behind CGI, WSGI or some proxies
read `X_Api_Key` as `X-Api-Key`). A path matches a rule's prefix only if it stays inside it however a lenient
server reads it: percent-decoding (once or again), overlong UTF-8, backslashes, `;` parameters, `//`, dot segments.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.decide import AllowRule, match_allowlist
from wakeful.proxy.paths import AmbiguousPath, normalize_path
from wakeful.proxy.rewrite import CREDENTIAL_HEADERS, HOP_BY_HOP, strip_credentials

RULE = AllowRule(name="api", host="api.example.com", ports=frozenset({443}), methods=frozenset({"GET"}),
                 path_prefix="/v1")
STRIPPED = sorted(CREDENTIAL_HEADERS | HOP_BY_HOP | {"x-wakeful-attempt", "cookie"})


# --- header names ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["X_Api_Key", "x_api_key", "Transfer_Encoding", "PROXY_AUTHORIZATION",
                                  "X_Wakeful_Attempt", "X-Auth_Token", "Proxy_Connection", "Keep_Alive"])
def test_a_stripped_header_spelled_with_underscores_is_stripped(name: str) -> None:
    assert strip_credentials([(name, "v"), ("Accept", "*/*")], bound_host=True) == [("Accept", "*/*")]


def test_a_header_that_connection_nominates_is_stripped_in_any_spelling() -> None:
    headers = [("Connection", "x-secret_thing"), ("X_Secret-Thing", "1"), ("Accept", "*/*")]
    assert strip_credentials(headers, bound_host=False) == [("Accept", "*/*")]


@given(st.sampled_from(STRIPPED), st.data())
@settings(max_examples=400, deadline=None)
def test_no_spelling_of_a_stripped_header_survives(name: str, data: st.DataObject) -> None:
    spelled = "".join(
        data.draw(st.sampled_from(["-", "_"])) if c == "-" else data.draw(st.sampled_from([c.lower(), c.upper()]))
        for c in name)
    assert strip_credentials([(spelled, "v")], bound_host=True) == []


# --- paths -------------------------------------------------------------------------------------------------------

def _lenient_utf8(raw: bytes) -> str:
    """How a careless server decodes: overlong forms accepted, anything invalid read as Latin-1."""
    out, i = [], 0
    while i < len(raw):
        b = raw[i]
        if 0xC0 <= b < 0xE0 and i + 1 < len(raw) and raw[i + 1] & 0xC0 == 0x80:
            out.append(chr(((b & 0x1F) << 6) | (raw[i + 1] & 0x3F)))
            i += 2
        elif 0xE0 <= b < 0xF0 and i + 2 < len(raw) and raw[i + 1] & 0xC0 == 0x80 and raw[i + 2] & 0xC0 == 0x80:
            out.append(chr(((b & 0x0F) << 12) | ((raw[i + 1] & 0x3F) << 6) | (raw[i + 2] & 0x3F)))
            i += 3
        else:
            out.append(chr(b))
            i += 1
    return "".join(out)


def _percent_decode(text: str) -> str:
    raw = re.sub(rb"%([0-9A-Fa-f]{2})", lambda m: bytes([int(m.group(1), 16)]), text.encode("latin-1"))
    return _lenient_utf8(raw)


def lenient_server(path: str, decodings: int) -> str:
    """The path a lenient server resolves: decoded `decodings` times, `\\` as `/`, `;params` dropped, empty
    segments collapsed, dot segments resolved."""
    for _ in range(decodings):
        path = _percent_decode(path)
    out: list[str] = []
    for segment in path.replace("\\", "/").split("/"):
        segment = segment.split(";", 1)[0]
        if segment in ("", "."):
            continue
        if segment == "..":
            if out:
                out.pop()
            continue
        out.append(segment)
    return "/" + "/".join(out)


def inside(path: str, prefix: str = "/v1") -> bool:
    return path == prefix or path.startswith(prefix + "/")


@pytest.mark.parametrize("path", [
    "/v1/%c0%ae%c0%ae/admin", "/v1/%e0%80%ae%e0%80%ae/admin", "/v1%c0%afadmin", "/v1/%252e%252e/admin",
    "/v1/..%2fadmin", "/v1/%2e%2e%5cadmin", "/v1\\..\\admin", "/v1/..;/admin", "/v1/.%2e/admin", "/v1//../admin",
    "/v1/%2E%2E/admin", "/v1/../admin", "/v1/a/../../admin", "/v1/%00/admin", "/v1/%zz",
])
def test_a_path_that_a_server_may_read_outside_the_prefix_does_not_match_it(path: str) -> None:
    assert match_allowlist([RULE], "api.example.com", 443, "GET", path) is None


@pytest.mark.parametrize("path", ["/v1", "/v1/", "/v1/items", "/v1/a/../b", "/v1/./items", "/v1/caf%C3%A9",
                                  "/v1/a%20b", "/v1/a;b=c"])
def test_a_path_inside_the_prefix_however_it_is_read_still_matches(path: str) -> None:
    assert match_allowlist([RULE], "api.example.com", 443, "GET", path) is RULE


PIECES = ["v1", "admin", "a", ".", "..", "%2e", "%2E", "%c0%ae", "%c0%ae%c0%ae", ".%c0%ae", "%e0%80%ae", "%c0%af",
          "%252e", "%25", "%2f",
          "%5c", "\\", ";", ";x", "", "%00", "%c3%a9", "%20", "%", "%c0"]
segments = st.lists(st.sampled_from(PIECES), min_size=0, max_size=3).map("".join)
paths = st.lists(segments, min_size=1, max_size=6).map(lambda parts: "/" + "/".join(parts))
paths = paths | paths.map(lambda path: "/v1" + path)  # most paths that matter start inside the prefix


@given(paths)
@settings(max_examples=3000, deadline=None)
def test_no_path_that_a_lenient_server_resolves_outside_a_rules_prefix_matches_it(path: str) -> None:
    if match_allowlist([RULE], "api.example.com", 443, "GET", path) is not None:
        # What the upstream gets is the canonical wire form (the proxy forwards nothing else), however it reads it.
        wire = normalize_path(path).wire
        assert normalize_path(wire).wire == wire
        for decodings in (0, 1, 2, 3):
            assert inside(lenient_server(wire, decodings)), (path, wire, decodings)
        for decodings in (1, 2, 3):
            assert inside(lenient_server(path, decodings)), (path, decodings)


@given(st.lists(st.sampled_from(["v1", "admin", "a", ".", ".."]), min_size=1, max_size=6))
@settings(max_examples=500, deadline=None)
def test_a_plain_path_matches_exactly_when_its_dot_segments_resolve_inside_the_prefix(parts: list[str]) -> None:
    path = "/" + "/".join(parts)
    matched = match_allowlist([RULE], "api.example.com", 443, "GET", path) is not None
    assert matched == inside(lenient_server(path, 0))


@pytest.mark.parametrize(("path", "wire", "decoded"), [
    ("/", "/", "/"), ("/v1", "/v1", "/v1"), ("/v1/", "/v1/", "/v1/"), ("/v1/a/../b", "/v1/b", "/v1/b"),
    ("/v1/%2e%2E/admin", "/admin", "/admin"), ("/a/..", "/", "/"), ("/../x", "/x", "/x"),
    ("/v1/caf%C3%A9/./x", "/v1/caf%C3%A9/x", "/v1/café/x"), ("/v1/a;b=c", "/v1/a;b=c", "/v1/a;b=c"),
])
def test_a_path_is_forwarded_with_its_dot_segments_resolved_and_every_other_segment_as_written(
        path: str, wire: str, decoded: str) -> None:
    normal = normalize_path(path)
    assert (normal.wire, normal.decoded) == (wire, decoded)


@pytest.mark.parametrize("path", ["v1", "/v1/%c0%ae", "/v1/%2f", "/v1/%5C", "/v1\\x", "/v1/%00", "/v1/%0d%0a",
                                  "/v1/%2525", "/v1/%", "/v1/%g0", "/v1/..;x/a", "/a//../b", "/v1/;/..", "/v1/%ff",
                                  "/v1/é"])
def test_a_path_that_can_be_read_two_ways_is_ambiguous(path: str) -> None:
    with pytest.raises(AmbiguousPath):
        normalize_path(path)
