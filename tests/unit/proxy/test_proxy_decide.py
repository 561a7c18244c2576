"""The checks around a decision: methods, addresses, host agreement, the tool-computer allowlist."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from wakeful.proxy.contract import Allow, ContractError, DecisionRequest, RefusalCode, Refuse
from wakeful.proxy.decide import (
    AllowRule,
    agree,
    check_addresses,
    check_request,
    check_verdict,
    decide_by_allowlist,
    is_public_address,
    match_allowlist,
)
from wakeful.proxy.hosts import normalize_host, parse_authority

REQ = DecisionRequest(request_id="req_1", user_id="usr_1", attempt_token=None, client_token="tok_1",
                      method="GET", scheme="https",
                      host="api.example.com", port=443, path="/v1/items", query="", resolved_ips=("93.184.216.34",),
                      body_sha256=hashlib.sha256(b"").hexdigest(), client="tool_computer")
RULES = (
    AllowRule(name="api", host="api.example.com", ports=frozenset({443}), methods=frozenset({"GET", "POST"}),
              path_prefix="/v1", credential="example_api"),
    AllowRule(name="cdn", host="*.cdn.example.net", ports=frozenset({443, 8443}), methods=frozenset({"GET"})),
)
NONE: frozenset[str] = frozenset()


def code(result: object) -> RefusalCode | None:
    return result.code if isinstance(result, Refuse) else None


# --- methods and addresses -------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["TRACE", "TRACK"])
def test_trace_is_refused_whatever_the_address(method: str) -> None:
    assert code(check_request(dataclasses.replace(REQ, method=method), allowed_private=NONE)) \
        == RefusalCode.METHOD_NOT_ALLOWED


def test_a_request_to_a_public_address_passes_the_checks() -> None:
    assert check_request(REQ, allowed_private=NONE) is None


@pytest.mark.parametrize("ip", [
    "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "100.64.0.1", "0.0.0.0", "224.0.0.1",
    "239.255.255.250", "240.0.0.1", "255.255.255.255", "192.0.2.1", "198.18.0.1",
    "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "fec0::1", "ff02::1", "2001:db8::1",
    "::ffff:127.0.0.1", "::ffff:10.0.0.1", "::ffff:169.254.169.254", "::127.0.0.1", "2002:7f00:1::1",
    "64:ff9b::a00:1", "2001::1",
])
def test_an_address_in_a_private_loopback_link_local_multicast_or_reserved_range_is_refused(ip: str) -> None:
    req = dataclasses.replace(REQ, resolved_ips=("93.184.216.34", ip))
    assert code(check_request(req, allowed_private=NONE)) == RefusalCode.ADDRESS_NOT_ALLOWED


@pytest.mark.parametrize("ip", ["93.184.216.34", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8",
                                "64:ff9b::808:808"])
def test_a_public_address_in_any_spelling_is_public(ip: str) -> None:
    assert is_public_address(ip)


def test_a_loopback_upstream_passes_only_when_its_host_is_explicitly_allowed() -> None:
    req = dataclasses.replace(REQ, host="127.0.0.1", resolved_ips=("127.0.0.1",))
    assert code(check_request(req, allowed_private=NONE)) == RefusalCode.ADDRESS_NOT_ALLOWED
    assert check_request(req, allowed_private=frozenset({"127.0.0.1"})) is None
    other = dataclasses.replace(req, host="internal.example.com")
    assert code(check_request(other, allowed_private=frozenset({"127.0.0.1"}))) == RefusalCode.ADDRESS_NOT_ALLOWED


def test_allowed_private_hosts_compare_in_normal_form() -> None:
    assert check_addresses("LocalHost.", ["127.0.0.1"], allowed_private=frozenset({"localhost"})) is None


@pytest.mark.parametrize("ip", ["0.0.0.0", "::", "::ffff:0.0.0.0", "224.0.0.1"])
def test_unspecified_and_multicast_addresses_are_refused_even_for_allowed_hosts(ip: str) -> None:
    assert code(check_addresses("localhost", [ip], allowed_private=frozenset({"localhost"}))) \
        == RefusalCode.ADDRESS_NOT_ALLOWED


def test_a_host_with_no_checked_address_is_never_dialled() -> None:
    assert code(check_request(dataclasses.replace(REQ, resolved_ips=()), allowed_private=NONE)) \
        == RefusalCode.ADDRESS_NOT_ALLOWED


@given(st.ip_addresses())
@settings(max_examples=300, deadline=None)
def test_an_address_that_python_does_not_call_global_is_never_public(ip: object) -> None:
    if not ip.is_global or ip.is_multicast:  # type: ignore[attr-defined]
        assert not is_public_address(str(ip))


# --- host agreement --------------------------------------------------------------------------------------------

def test_connect_target_sni_and_host_header_that_name_one_host_agree() -> None:
    assert agree(("Api.Example.com.", 443), "api.example.com", "API.EXAMPLE.COM", 443)
    assert agree(("api.example.com", 8443), "api.example.com", "api.example.com:8443", 8443)
    assert agree(None, None, "example.com", 80, scheme="http")
    assert agree(("::1", 443), None, "[::1]:443", 443)


@pytest.mark.parametrize(("target", "sni", "host_header", "port"), [
    (("api.example.com", 443), "evil.example.com", None, 443),
    (("api.example.com", 443), None, "evil.example.com", 443),
    (None, "api.example.com", "evil.example.com", 443),
    (("api.example.com", 443), None, "api.example.com", 8443),
    (None, "api.example.com", "api.example.com:8443", 443),
    (None, None, "api.example.com", 8080),
    (None, "api.example.com", "api.example.com", 80),
    (None, None, "api.example.com:443@evil.com", 443),
    (None, None, "api.example.com, evil.com", 443),
    (None, None, "", 443),
    (None, None, None, 443),
])
def test_names_or_ports_that_disagree_do_not_agree(target: tuple[str, int] | None, sni: str | None,
                                                   host_header: str | None, port: int) -> None:
    assert not agree(target, sni, host_header, port)


@given(st.from_regex(r"[a-z]{1,10}\.[a-z]{2,5}", fullmatch=True), st.from_regex(r"[a-z]{1,10}\.[a-z]{2,5}",
                                                                                 fullmatch=True))
def test_two_different_host_names_never_agree(a: str, b: str) -> None:
    assume(a != b)
    assert not agree((a, 443), b, None, 443)
    assert not agree(None, a, b, 443)


@pytest.mark.parametrize("host", ["2130706433", "0x7f.1", "0177.0.0.1", "127.000.000.001", "ex ample.com",
                                  "exämple.com", "a..b", "", "[::1%eth0]", "-bad.com"])
def test_host_names_that_spell_addresses_oddly_or_are_not_names_are_rejected(host: str) -> None:
    with pytest.raises(ValueError):
        normalize_host(host)


def test_authorities_parse_into_a_normal_host_and_an_optional_port() -> None:
    assert parse_authority("Example.COM.:8080") == ("example.com", 8080)
    assert parse_authority("[0:0::1]") == ("::1", None)
    for bad in ["example.com:", "example.com:+80", "example.com:99999", "::1", "[::1]x"]:
        with pytest.raises(ValueError):
            parse_authority(bad)


# --- the allowlist ---------------------------------------------------------------------------------------------

def test_a_request_matching_an_exact_rule_returns_that_rule() -> None:
    assert match_allowlist(RULES, "API.example.com", 443, "post", "/v1/items") == RULES[0]


@pytest.mark.parametrize(("host", "port", "method", "path"), [
    ("api.example.com", 8443, "GET", "/v1/x"),            # port
    ("api.example.com", 443, "DELETE", "/v1/x"),          # method
    ("api.example.com", 443, "GET", "/v2/x"),             # path
    ("api.example.com", 443, "GET", "/v1x"),              # prefix is segment-wise
    ("api.example.com", 443, "GET", "/v1/../admin"),      # dot segments walk out of the prefix
    ("api.example.com", 443, "GET", "/v1/%2e%2e/admin"),
    ("api.example.com", 443, "GET", "/v1/%252e%252e/admin"),
    ("api.example.com", 443, "GET", "/v1/..;/admin"),
    ("api.example.com", 443, "GET", "/v1/a%2fb"),
    ("api.example.com", 443, "GET", "/v1\\..\\admin"),
    ("evil-api.example.com", 443, "GET", "/v1/x"),
    ("cdn.example.net", 443, "GET", "/x"),                # a wildcard never matches the bare apex
    ("xcdn.example.net", 443, "GET", "/x"),
    ("a.cdn.example.net.evil.com", 443, "GET", "/x"),
    ("not a host", 443, "GET", "/x"),
])
def test_a_request_outside_every_rule_matches_nothing(host: str, port: int, method: str, path: str) -> None:
    assert match_allowlist(RULES, host, port, method, path) is None


def test_a_wildcard_matches_one_label_or_more_below_its_domain() -> None:
    assert match_allowlist(RULES, "a.cdn.example.net", 8443, "GET", "/x") == RULES[1]
    assert match_allowlist(RULES, "a.b.cdn.example.net", 443, "GET", "/x") == RULES[1]


@pytest.mark.parametrize("change", [
    {"host": "*.com"}, {"host": "*.1.2.3.4"}, {"host": "API.example.com"}, {"host": "*"},
    {"ports": frozenset()}, {"ports": frozenset({0})}, {"methods": frozenset({"get"})},
    {"methods": frozenset({"TRACE"})}, {"path_prefix": "v1"}, {"credential": "Not A Name"},
    {"host": "*.example.com"},  # with a credential, the host must be exact
])
def test_a_rule_that_is_too_broad_or_malformed_is_refused_on_construction(change: dict[str, object]) -> None:
    with pytest.raises(ContractError):
        dataclasses.replace(RULES[0], **change)  # type: ignore[arg-type]


hosts = st.from_regex(r"[a-z]{1,6}(\.[a-z]{1,6}){1,3}", fullmatch=True)
rules = st.builds(
    lambda name, host, wild, ports, methods, prefix: AllowRule(
        name=name, host=f"*.{host}" if wild else host, ports=frozenset(ports), methods=frozenset(methods),
        path_prefix=prefix),
    st.text("abc", min_size=1, max_size=3), hosts, st.booleans(), st.sets(st.sampled_from([80, 443, 8443]), min_size=1),
    st.sets(st.sampled_from(["GET", "POST", "PUT"]), min_size=1), st.sampled_from(["/", "/v1", "/v1/", "/a/b"]))
requests = st.builds(
    lambda host, port, method, path: dataclasses.replace(REQ, host=host, port=port, method=method, path=path),
    hosts, st.sampled_from([80, 443, 8443, 9000]), st.sampled_from(["GET", "POST", "PUT", "DELETE"]),
    st.sampled_from(["/", "/v1", "/v1/x", "/v1x", "/a/b/c", "/a/../v1", "/b"]))


@given(st.lists(rules, max_size=4), requests)
@settings(max_examples=300, deadline=None)
def test_a_request_matched_by_no_rule_is_refused(rule_list: list[AllowRule], req: DecisionRequest) -> None:
    verdict = decide_by_allowlist(req, rule_list)
    matched = match_allowlist(rule_list, req.host, req.port, req.method, req.path)
    if matched is None:
        assert code(verdict) == RefusalCode.HOST_NOT_ALLOWED
    else:
        assert isinstance(verdict, Allow) and verdict.rule == matched.name
        assert matched.matches_host(req.host) and req.port in matched.ports and req.method in matched.methods


def test_an_allowed_tool_computer_request_names_its_rule_and_credential() -> None:
    assert decide_by_allowlist(REQ, RULES) == Allow(credential="example_api", rule="api", attempt_id=None,
                                                    action_id=None)


def test_a_connector_call_is_never_decided_by_the_allowlist() -> None:
    req = dataclasses.replace(REQ, client="connector", attempt_token="tok")
    assert code(decide_by_allowlist(req, RULES)) == RefusalCode.NOT_ADMITTED


# --- a verdict must fit its request ------------------------------------------------------------------------------

def test_a_connector_allow_without_an_attempt_does_not_fit() -> None:
    connector = dataclasses.replace(REQ, client="connector", attempt_token="tok")
    good = Allow(credential=None, rule="act", attempt_id="att_1", action_id="act_1")
    assert check_verdict(connector, good) == good
    read = Allow(credential=None, rule="read", attempt_id="egr_1", action_id=None)  # a read tool: no action
    assert check_verdict(connector, read) == read
    bare = Allow(credential=None, rule="act", attempt_id=None, action_id="act_1")
    assert code(check_verdict(connector, bare)) == RefusalCode.MALFORMED_VERDICT
    no_token = dataclasses.replace(connector, attempt_token=None)
    assert code(check_verdict(no_token, good)) == RefusalCode.MALFORMED_VERDICT


def test_a_tool_computer_allow_naming_an_attempt_does_not_fit() -> None:
    allow = Allow(credential=None, rule="r", attempt_id="att_1", action_id="act_1")
    assert code(check_verdict(REQ, allow)) == RefusalCode.MALFORMED_VERDICT
