"""Webhook signature verification: published vectors, every error code for every kind, and sign/verify properties.

Expected signatures are computed here with hmac/hashlib (or taken from the providers' docs), never from the module.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable
from typing import get_args

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from starlette.datastructures import Headers

from wakeful.server.core.signatures import SignatureError, SignatureKind, sign, verify_signature

KINDS: tuple[SignatureKind, ...] = get_args(SignatureKind)
SECRET = b"whsec_test_secret"
BODY = b'{"id":"evt_1","type":"ping"}'
NOW = 1_700_000_000
DELIVERY = "dlv_1"


def hexmac(secret: bytes, payload: bytes) -> str:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def error_code(
    kind: SignatureKind,
    headers: dict[str, str],
    *,
    body: bytes = BODY,
    now: float = NOW,
    secret: bytes = SECRET,
    tolerance_seconds: int = 300,
) -> str:
    with pytest.raises(SignatureError) as info:
        verify_signature(kind, secret=secret, body=body, headers=headers, now=now, tolerance_seconds=tolerance_seconds)
    return info.value.code


def stripe_header(t: int | str, *sigs: str) -> dict[str, str]:
    return {"Stripe-Signature": ",".join([f"t={t}", *sigs])}


def slack_headers(ts: int | str, sig: str) -> dict[str, str]:
    return {"X-Slack-Request-Timestamp": str(ts), "X-Slack-Signature": sig}


def good_stripe_sig(t: int = NOW, body: bytes = BODY) -> str:
    return "v1=" + hexmac(SECRET, f"{t}.".encode() + body)


def good_slack_sig(ts: int = NOW, body: bytes = BODY) -> str:
    return "v0=" + hexmac(SECRET, f"v0:{ts}:".encode() + body)


def generic_headers(ts: int | str = NOW, delivery: str = DELIVERY, sig: str | None = None) -> dict[str, str]:
    """The generic scheme's three headers; the signature, unless given, is the documented recipe."""
    sig = sig or "v1=" + hexmac(SECRET, f"{ts}\n{delivery}\n".encode() + BODY)
    return {"X-Wakeful-Timestamp": str(ts), "X-Wakeful-Delivery": delivery, "X-Wakeful-Signature": sig}


# --- published vectors ----------------------------------------------------------------------------------------


def test_github_documented_example_verifies() -> None:
    # docs.github.com, "Validating webhook deliveries".
    verify_signature(
        "github",
        secret=b"It's a Secret to Everybody",
        body=b"Hello, World!",
        headers={"X-Hub-Signature-256": "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"},
        now=NOW,
    )


SLACK_DOC_BODY = (
    b"token=xyzz0WbapA4vBCDEFasx0q6G&team_id=T1DC2JH3J&team_domain=testteamnow&channel_id=G8PSS9T3V"
    b"&channel_name=foobar&user_id=U2CERLKJA&user_name=roadrunner&command=%2Fwebhook-collect&text="
    b"&response_url=https%3A%2F%2Fhooks.slack.com%2Fcommands%2FT1DC2JH3J%2F397700885554%2F96rGlfmibIGlgcZRskXaIFfN"
    b"&trigger_id=398738663015.47445629121.803a0bc887a14d10d2c447fce8b6703c"
)


def test_slack_documented_example_verifies() -> None:
    # api.slack.com, "Verifying requests from Slack".
    verify_signature(
        "slack",
        secret=b"8f742231b10e8888abcd99yyyzzz85a5",
        body=SLACK_DOC_BODY,
        headers=slack_headers(1531420618, "v0=a2114d57b48eac39b9ad189dd8316235a7b4a8d21a10bd27519666489c69b503"),
        now=1531420618 + 60,
    )


# --- independently computed vectors and round trips -------------------------------------------------------------


def test_github_signature_computed_independently_verifies() -> None:
    verify_signature(
        "github", secret=SECRET, body=BODY, headers={"X-Hub-Signature-256": "sha256=" + hexmac(SECRET, BODY)}, now=NOW
    )


def test_generic_signature_computed_independently_verifies() -> None:
    verify_signature("generic", secret=SECRET, body=BODY, headers=generic_headers(), now=NOW)


def test_stripe_signature_computed_independently_verifies() -> None:
    verify_signature("stripe", secret=SECRET, body=BODY, headers=stripe_header(NOW, good_stripe_sig()), now=NOW)


def test_slack_signature_computed_independently_verifies() -> None:
    verify_signature("slack", secret=SECRET, body=BODY, headers=slack_headers(NOW, good_slack_sig()), now=NOW)


def test_sign_produces_exactly_the_independently_computed_headers() -> None:
    github = {"X-Hub-Signature-256": "sha256=" + hexmac(SECRET, BODY), "X-GitHub-Delivery": DELIVERY}
    assert sign("github", secret=SECRET, body=BODY, now=NOW, delivery_id=DELIVERY) == github
    assert sign("generic", secret=SECRET, body=BODY, now=NOW, delivery_id=DELIVERY) == generic_headers()
    assert sign("stripe", secret=SECRET, body=BODY, now=NOW) == stripe_header(NOW, good_stripe_sig())
    assert sign("slack", secret=SECRET, body=BODY, now=NOW) == slack_headers(NOW, good_slack_sig())


def test_sign_truncates_a_fractional_now_to_whole_seconds() -> None:
    assert sign("stripe", secret=SECRET, body=BODY, now=NOW + 0.9) == stripe_header(NOW, good_stripe_sig())


@pytest.mark.parametrize("kind", KINDS)
def test_signed_delivery_round_trips_for_every_kind(kind: SignatureKind) -> None:
    headers = sign(kind, secret=SECRET, body=BODY, now=NOW, delivery_id=DELIVERY)
    verify_signature(kind, secret=SECRET, body=BODY, headers=headers, now=NOW)


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_body_round_trips_for_every_kind(kind: SignatureKind) -> None:
    headers = sign(kind, secret=SECRET, body=b"", now=NOW, delivery_id=DELIVERY)
    verify_signature(kind, secret=SECRET, body=b"", headers=headers, now=NOW)


# --- header casing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("recase", [str.lower, str.upper, str.swapcase], ids=["lower", "upper", "swapped"])
def test_header_names_match_in_any_casing(kind: SignatureKind, recase: Callable[[str], str]) -> None:
    headers = {recase(k): v for k, v in sign(kind, secret=SECRET, body=BODY, now=NOW, delivery_id=DELIVERY).items()}
    verify_signature(kind, secret=SECRET, body=BODY, headers=headers, now=NOW)


@pytest.mark.parametrize("kind", KINDS)
def test_starlette_headers_object_is_accepted(kind: SignatureKind) -> None:
    headers = sign(kind, secret=SECRET, body=BODY, now=NOW, delivery_id=DELIVERY)
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    verify_signature(kind, secret=SECRET, body=BODY, headers=Headers(raw=raw), now=NOW)


def test_hex_digest_in_upper_case_is_accepted() -> None:
    headers = {"X-Hub-Signature-256": "sha256=" + hexmac(SECRET, BODY).upper()}
    verify_signature("github", secret=SECRET, body=BODY, headers=headers, now=NOW)


# --- signature_missing -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_delivery_without_signature_headers_is_missing(kind: SignatureKind) -> None:
    assert error_code(kind, {"Content-Type": "application/json"}) == "signature_missing"


@pytest.mark.parametrize("kind", KINDS)
def test_blank_signature_header_is_missing(kind: SignatureKind) -> None:
    headers = dict.fromkeys(sign(kind, secret=SECRET, body=BODY, now=NOW, delivery_id=DELIVERY), "  ")
    assert error_code(kind, headers) == "signature_missing"


def test_slack_without_timestamp_header_is_missing() -> None:
    assert error_code("slack", {"X-Slack-Signature": good_slack_sig()}) == "signature_missing"


def test_slack_without_signature_header_is_missing() -> None:
    assert error_code("slack", {"X-Slack-Request-Timestamp": str(NOW)}) == "signature_missing"


def test_github_signature_sent_under_the_generic_header_is_missing() -> None:
    assert error_code("github", {"X-Wakeful-Signature": "sha256=" + hexmac(SECRET, BODY)}) == "signature_missing"


# --- signature_malformed ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("sha1=" + "a" * 64, id="wrong-algorithm-prefix"),
        pytest.param(hexmac(SECRET, BODY), id="no-prefix"),
        pytest.param("sha256=" + "a" * 63, id="too-short"),
        pytest.param("sha256=" + "a" * 65, id="too-long"),
        pytest.param("sha256=" + "g" * 64, id="not-hex"),
        pytest.param("sha256=" + "a" * 32 + " " + "a" * 31, id="embedded-space"),
        pytest.param("sha256=", id="empty-digest"),
    ],
)
def test_github_signature_with_bad_shape_is_malformed(value: str) -> None:
    assert error_code("github", {"X-Hub-Signature-256": value}) == "signature_malformed"


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(generic_headers(sig="sha256=" + hexmac(SECRET, BODY)), id="the-retired-body-only-scheme"),
        pytest.param(generic_headers(sig=hexmac(SECRET, BODY)), id="no-prefix"),
        pytest.param(generic_headers(sig="v1=" + "a" * 63), id="too-short"),
        pytest.param(generic_headers(sig="v1=" + "g" * 64), id="not-hex"),
        pytest.param(generic_headers(sig="v1="), id="empty-digest"),
        pytest.param(generic_headers(ts="soon"), id="non-integer-timestamp"),
        pytest.param(generic_headers(ts=f"{NOW}.0"), id="fractional-timestamp"),
        pytest.param(generic_headers(ts="-5"), id="negative-timestamp"),
        pytest.param(generic_headers(ts="9" * 16), id="timestamp-too-long"),
        pytest.param(generic_headers(ts="\u0661\u0662"), id="non-ascii-digits"),
        pytest.param(generic_headers(delivery="d 1"), id="space-in-delivery-id"),
        pytest.param(generic_headers(delivery="caf\u00e9"), id="non-ascii-delivery-id"),
        pytest.param(generic_headers(delivery="x" * 201), id="delivery-id-too-long"),
    ],
)
def test_generic_headers_with_bad_shape_are_malformed(headers: dict[str, str]) -> None:
    assert error_code("generic", headers) == "signature_malformed"


@pytest.mark.parametrize("missing", ["X-Wakeful-Signature", "X-Wakeful-Timestamp", "X-Wakeful-Delivery"])
def test_generic_without_any_one_of_its_headers_is_missing(missing: str) -> None:
    headers = generic_headers()
    del headers[missing]
    with pytest.raises(SignatureError) as info:
        verify_signature("generic", secret=SECRET, body=BODY, headers=headers, now=NOW)
    assert info.value.code == "signature_missing" and missing in info.value.message


@pytest.mark.parametrize(
    "value",
    [
        pytest.param("v1=" + "a" * 64, id="no-t"),
        pytest.param(f"t={NOW}", id="no-v1"),
        pytest.param(f"t={NOW},v0=" + "a" * 64, id="only-v0"),
        pytest.param("t=soon,v1=" + "a" * 64, id="non-integer-t"),
        pytest.param(f"t={NOW}.5,v1=" + "a" * 64, id="fractional-t"),
        pytest.param("t=-5,v1=" + "a" * 64, id="negative-t"),
        pytest.param("t=,v1=" + "a" * 64, id="empty-t"),
        pytest.param(f"t={NOW},t={NOW},v1=" + "a" * 64, id="two-t"),
        pytest.param(f"t={NOW},v1=" + "a" * 63, id="short-v1"),
        pytest.param(f"t={NOW},v1=" + "z" * 64, id="non-hex-v1"),
        pytest.param(f"t={NOW},garbage", id="element-without-equals"),
    ],
)
def test_stripe_header_with_bad_shape_is_malformed(value: str) -> None:
    assert error_code("stripe", {"Stripe-Signature": value}) == "signature_malformed"


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param(slack_headers("soon", good_slack_sig()), id="non-integer-timestamp"),
        pytest.param(slack_headers(f"{NOW}.0", good_slack_sig()), id="fractional-timestamp"),
        pytest.param(slack_headers(NOW, "v1=" + hexmac(SECRET, b"x")), id="wrong-version-prefix"),
        pytest.param(slack_headers(NOW, hexmac(SECRET, b"x")), id="no-prefix"),
        pytest.param(slack_headers(NOW, "v0=" + "a" * 60), id="short-digest"),
        pytest.param(slack_headers(NOW, "v0=" + "q" * 64), id="non-hex-digest"),
    ],
)
def test_slack_headers_with_bad_shape_are_malformed(headers: dict[str, str]) -> None:
    assert error_code("slack", headers) == "signature_malformed"


# --- signature_mismatch ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_body_altered_by_one_byte_is_a_mismatch(kind: SignatureKind) -> None:
    headers = sign(kind, secret=SECRET, body=BODY, now=NOW, delivery_id=DELIVERY)
    altered = BODY[:-1] + bytes([BODY[-1] ^ 0x01])
    assert error_code(kind, headers, body=altered) == "signature_mismatch"


@pytest.mark.parametrize("kind", KINDS)
def test_signature_made_with_another_secret_is_a_mismatch(kind: SignatureKind) -> None:
    headers = sign(kind, secret=b"someone-else", body=BODY, now=NOW, delivery_id=DELIVERY)
    assert error_code(kind, headers) == "signature_mismatch"


def test_stripe_with_several_v1_values_passes_when_any_one_matches() -> None:
    # During a secret rotation Stripe sends one v1 per active secret, plus a v0 for test mode.
    headers = stripe_header(NOW, "v1=" + "0" * 64, good_stripe_sig(), "v1=" + "f" * 64, "v0=" + "1" * 64)
    verify_signature("stripe", secret=SECRET, body=BODY, headers=headers, now=NOW)


def test_stripe_with_several_v1_values_is_a_mismatch_when_none_matches() -> None:
    headers = stripe_header(NOW, "v1=" + "0" * 64, "v1=" + "f" * 64)
    assert error_code("stripe", headers) == "signature_mismatch"


def test_stripe_matching_v0_alone_is_not_enough() -> None:
    headers = stripe_header(NOW, "v1=" + "0" * 64, "v0=" + hexmac(SECRET, f"{NOW}.".encode() + BODY))
    assert error_code("stripe", headers) == "signature_mismatch"


def test_stripe_signature_replayed_with_a_different_timestamp_is_a_mismatch() -> None:
    # The timestamp is part of the signed payload, so moving it forward to dodge the expiry check fails.
    headers = stripe_header(NOW + 10, good_stripe_sig(t=NOW))
    assert error_code("stripe", headers, now=NOW + 10) == "signature_mismatch"


def test_generic_signature_replayed_with_a_different_timestamp_is_a_mismatch() -> None:
    headers = generic_headers(sig=generic_headers()["X-Wakeful-Signature"], ts=NOW + 10)
    assert error_code("generic", headers, now=NOW + 10) == "signature_mismatch"


@pytest.mark.parametrize("other", ["dlv_2", "DLV_1", "dlv_1."], ids=["another", "recased", "longer"])
def test_generic_signature_replayed_under_another_delivery_id_is_a_mismatch(other: str) -> None:
    headers = generic_headers(sig=generic_headers()["X-Wakeful-Signature"], delivery=other)
    assert error_code("generic", headers) == "signature_mismatch"


def test_generic_parts_cannot_be_cut_another_way() -> None:
    # The delivery ID may hold dots; moving part of it into the body (or back) changes the signed bytes.
    headers = sign("generic", secret=SECRET, body=b"b.{}", now=NOW, delivery_id="a")
    moved = headers | {"X-Wakeful-Delivery": "a.b"}
    assert error_code("generic", moved, body=b"{}") == "signature_mismatch"


def test_slack_signature_replayed_with_a_different_timestamp_is_a_mismatch() -> None:
    headers = slack_headers(NOW + 10, good_slack_sig(ts=NOW))
    assert error_code("slack", headers, now=NOW + 10) == "signature_mismatch"


def test_forged_stale_stripe_delivery_is_a_mismatch_not_expired() -> None:
    # Authenticity is checked before freshness: "expired" is reserved for genuine-but-stale deliveries.
    assert error_code("stripe", stripe_header(NOW - 3600, "v1=" + "0" * 64)) == "signature_mismatch"


# --- signature_expired -----------------------------------------------------------------------------------------


def test_stripe_signature_older_than_tolerance_is_expired() -> None:
    headers = stripe_header(NOW - 301, good_stripe_sig(t=NOW - 301))
    assert error_code("stripe", headers) == "signature_expired"


def test_stripe_signature_further_in_the_future_than_tolerance_is_expired() -> None:
    headers = stripe_header(NOW + 301, good_stripe_sig(t=NOW + 301))
    assert error_code("stripe", headers) == "signature_expired"


def test_slack_signature_older_than_tolerance_is_expired() -> None:
    headers = slack_headers(NOW - 301, good_slack_sig(ts=NOW - 301))
    assert error_code("slack", headers) == "signature_expired"


def test_slack_signature_further_in_the_future_than_tolerance_is_expired() -> None:
    headers = slack_headers(NOW + 301, good_slack_sig(ts=NOW + 301))
    assert error_code("slack", headers) == "signature_expired"


@pytest.mark.parametrize("skew", [-301, 301], ids=["older", "ahead"])
def test_generic_signature_beyond_the_tolerance_is_expired(skew: int) -> None:
    assert error_code("generic", generic_headers(ts=NOW + skew)) == "signature_expired"


def test_generic_signature_of_an_absurd_but_well_formed_time_is_expired() -> None:
    assert error_code("generic", generic_headers(ts="9" * 15)) == "signature_expired"


@pytest.mark.parametrize("kind", ["generic", "stripe", "slack"])
@pytest.mark.parametrize("skew", [-300, 300])
def test_timestamp_exactly_at_the_tolerance_edge_is_accepted(kind: SignatureKind, skew: int) -> None:
    headers = sign(kind, secret=SECRET, body=BODY, now=NOW + skew, delivery_id=DELIVERY)
    verify_signature(kind, secret=SECRET, body=BODY, headers=headers, now=NOW)


@pytest.mark.parametrize("kind", ["generic", "stripe", "slack"])
def test_custom_tolerance_is_honoured(kind: SignatureKind) -> None:
    headers = sign(kind, secret=SECRET, body=BODY, now=NOW - 10, delivery_id=DELIVERY)
    verify_signature(kind, secret=SECRET, body=BODY, headers=headers, now=NOW, tolerance_seconds=10)
    assert error_code(kind, headers, tolerance_seconds=9) == "signature_expired"


def test_github_signatures_never_expire() -> None:
    # GitHub signs no time: a replay is told apart by the digest instead (see the `Signed` tests below).
    headers = sign("github", secret=SECRET, body=BODY, now=0, delivery_id=DELIVERY)
    verify_signature("github", secret=SECRET, body=BODY, headers=headers, now=NOW)


# --- what a signature vouches for ------------------------------------------------------------------------------


def test_generic_vouches_for_its_delivery_id_and_timestamp_and_digests_all_it_signs() -> None:
    signed = verify_signature("generic", secret=SECRET, body=BODY, headers=generic_headers(), now=NOW)
    assert signed.headers == {"x-wakeful-delivery": DELIVERY, "x-wakeful-timestamp": str(NOW)}
    assert signed.digest == hashlib.sha256(f"{NOW}\n{DELIVERY}\n".encode() + BODY).hexdigest()


def test_github_vouches_for_no_header_and_its_digest_ignores_the_delivery_header() -> None:
    digests = set()
    for delivery in ("g-1", "g-2", None):
        headers = sign("github", secret=SECRET, body=BODY, now=NOW, delivery_id=delivery)
        signed = verify_signature("github", secret=SECRET, body=BODY, headers=headers, now=NOW)
        assert signed.headers == {}
        digests.add(signed.digest)
    assert digests == {hashlib.sha256(BODY).hexdigest()}


def test_stripe_digest_is_the_same_however_the_header_lists_its_signatures() -> None:
    # The header is not what is signed: extra or reordered v1 values must not make a replay look new.
    plain = stripe_header(NOW, good_stripe_sig())
    padded = stripe_header(NOW, "v1=" + "0" * 64, good_stripe_sig(), "v0=" + "1" * 64)
    digests = {verify_signature("stripe", secret=SECRET, body=BODY, headers=h, now=NOW).digest for h in (plain, padded)}
    assert digests == {hashlib.sha256(f"{NOW}.".encode() + BODY).hexdigest()}


def test_slack_vouches_for_its_timestamp() -> None:
    signed = verify_signature("slack", secret=SECRET, body=BODY, headers=slack_headers(NOW, good_slack_sig()), now=NOW)
    assert signed.headers == {"x-slack-request-timestamp": str(NOW)}


@pytest.mark.parametrize("delivery", [None, "", "d 1", "caf\u00e9"])
def test_signing_a_generic_delivery_needs_a_well_formed_delivery_id(delivery: str | None) -> None:
    with pytest.raises(ValueError):
        sign("generic", secret=SECRET, body=BODY, now=NOW, delivery_id=delivery)


# --- the error type and programming errors ---------------------------------------------------------------------


def test_signature_error_carries_code_and_message() -> None:
    err = SignatureError("signature_mismatch", "nope")
    assert err.code == "signature_mismatch"
    assert str(err) == "nope"


def test_signature_error_rejects_an_unknown_code() -> None:
    with pytest.raises(ValueError):
        SignatureError("signature_bogus", "x")


def test_error_message_never_contains_the_expected_signature() -> None:
    with pytest.raises(SignatureError) as info:
        verify_signature(
            "github", secret=SECRET, body=BODY, headers={"X-Hub-Signature-256": "sha256=" + "0" * 64}, now=NOW
        )
    assert hexmac(SECRET, BODY) not in str(info.value)


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_secret_is_refused_rather_than_trusted(kind: SignatureKind) -> None:
    with pytest.raises(ValueError):
        sign(kind, secret=b"", body=BODY, now=NOW, delivery_id=DELIVERY)
    with pytest.raises(ValueError):
        verify_signature(kind, secret=b"", body=BODY, headers={}, now=NOW)


# --- properties ------------------------------------------------------------------------------------------------

kinds = st.sampled_from(KINDS)
bodies = st.binary(max_size=2048)
# HMAC zero-pads keys up to the 64-byte block and hashes longer ones, so b"k" and b"k\x00" are the *same* key.
# Keep secrets within one block and compare them with trailing NULs stripped to mean "genuinely different".
secrets = st.binary(min_size=1, max_size=64).filter(lambda s: s.rstrip(b"\x00") != b"")
times = st.integers(min_value=0, max_value=2**40)
deliveries = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=200)


@given(kind=kinds, body=bodies, secret=secrets, now=times, delivery=deliveries)
def test_any_signed_delivery_verifies(kind: SignatureKind, body: bytes, secret: bytes, now: int,
                                      delivery: str) -> None:
    headers = sign(kind, secret=secret, body=body, now=now, delivery_id=delivery)
    verify_signature(kind, secret=secret, body=body, headers=headers, now=now)


@given(body=bodies, now=times, delivery=deliveries, other=deliveries)
def test_any_generic_delivery_under_another_id_is_a_mismatch(body: bytes, now: int, delivery: str, other: str) -> None:
    assume(delivery != other)
    headers = sign("generic", secret=SECRET, body=body, now=now, delivery_id=delivery)
    assert error_code("generic", headers | {"X-Wakeful-Delivery": other}, body=body, now=now) == "signature_mismatch"


@given(kind=kinds, body=bodies, secret=secrets, other=secrets, now=times)
def test_any_delivery_checked_with_another_secret_is_a_mismatch(
    kind: SignatureKind, body: bytes, secret: bytes, other: bytes, now: int
) -> None:
    assume(secret.rstrip(b"\x00") != other.rstrip(b"\x00"))
    headers = sign(kind, secret=secret, body=body, now=now, delivery_id=DELIVERY)
    assert error_code(kind, headers, body=body, secret=other, now=now) == "signature_mismatch"


@given(kind=kinds, body=bodies, secret=secrets, now=times, name_case=st.lists(st.booleans(), min_size=32))
def test_any_header_casing_verifies(
    kind: SignatureKind, body: bytes, secret: bytes, now: int, name_case: list[bool]
) -> None:
    def recase(name: str) -> str:
        return "".join(c.upper() if up else c.lower() for c, up in zip(name, name_case, strict=False))

    headers = {recase(k): v for k, v in sign(kind, secret=secret, body=body, now=now, delivery_id=DELIVERY).items()}
    verify_signature(kind, secret=secret, body=body, headers=headers, now=now)
