"""The deployment CA: sealed at rest, survives key rotation; leaves per host verify against it and are cached."""

from __future__ import annotations

import ipaddress
import json
import ssl
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509 import verification
from hypothesis import given, settings
from hypothesis import strategies as st

from wakeful.proxy.tls import CA_CERT_FILE, CA_KEY_FILE, CAError, LeafCertificates, ca_pem, load_or_create_ca, sni_of
from wakeful.proxy.vault import KeyRing, generate_key

KEYS = KeyRing(current=generate_key())


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2030, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def _der(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def test_the_ca_is_created_owner_only_and_its_private_key_is_not_stored_in_the_clear(tmp_path: Path) -> None:
    directory = tmp_path / "ca"
    ca = load_or_create_ca(directory, KEYS)
    assert directory.stat().st_mode & 0o777 == 0o700
    for name in (CA_CERT_FILE, CA_KEY_FILE):
        assert (directory / name).stat().st_mode & 0o777 == 0o600
    sealed = (directory / CA_KEY_FILE).read_bytes()
    assert _der(ca.key) not in sealed and b"PRIVATE KEY" not in sealed
    assert json.loads(sealed)["key_id"] == KEYS.current.key_id
    assert (directory / CA_CERT_FILE).read_bytes() == ca.ca_pem() == ca_pem(directory)


def test_loading_the_ca_again_gives_the_same_certificate_and_key(tmp_path: Path) -> None:
    first = load_or_create_ca(tmp_path / "ca", KEYS)
    second = load_or_create_ca(tmp_path / "ca", KEYS)
    assert second.cert == first.cert and _der(second.key) == _der(first.key)


def test_the_ca_certificate_is_a_p256_ca_for_about_ten_years(tmp_path: Path) -> None:
    clock = Clock()
    cert = load_or_create_ca(tmp_path / "ca", KEYS, clock=clock).cert
    assert cert.subject.rfc4514_string().startswith("O=wakeful,CN=wakeful deployment CA ")
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert constraints.critical and constraints.value.ca
    assert usage.key_cert_sign and usage.crl_sign
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    assert cert.public_key().curve.name == "secp256r1"  # type: ignore[union-attr]
    lifetime = cert.not_valid_after_utc - clock.now
    assert timedelta(days=3600) < lifetime <= timedelta(days=3660)


def test_a_ca_sealed_under_a_previous_key_loads_and_is_resealed_under_the_current_one(tmp_path: Path) -> None:
    old = load_or_create_ca(tmp_path / "ca", KEYS)
    new_key = generate_key()
    rotated = load_or_create_ca(tmp_path / "ca", KeyRing(current=new_key, previous=(KEYS.current,)))
    assert rotated.cert == old.cert
    assert json.loads((tmp_path / "ca" / CA_KEY_FILE).read_bytes())["key_id"] == new_key.key_id
    assert load_or_create_ca(tmp_path / "ca", KeyRing(current=new_key)).cert == old.cert


def test_a_ca_is_refused_under_a_key_it_was_not_sealed_with(tmp_path: Path) -> None:
    load_or_create_ca(tmp_path / "ca", KEYS)
    with pytest.raises(CAError, match="not loaded"):
        load_or_create_ca(tmp_path / "ca", KeyRing(current=generate_key()))


def test_a_tampered_ca_key_file_is_refused(tmp_path: Path) -> None:
    load_or_create_ca(tmp_path / "ca", KEYS)
    path = tmp_path / "ca" / CA_KEY_FILE
    doc = json.loads(path.read_bytes())
    doc["ciphertext"] = doc["ciphertext"][:-8] + ("A" * 8 if not doc["ciphertext"].endswith("A" * 8) else "B" * 8)
    path.write_text(json.dumps(doc))
    with pytest.raises(CAError, match="does not decrypt|malformed"):
        load_or_create_ca(tmp_path / "ca", KEYS)


def test_a_certificate_that_does_not_match_the_key_is_refused(tmp_path: Path) -> None:
    load_or_create_ca(tmp_path / "a", KEYS)
    other = load_or_create_ca(tmp_path / "b", KEYS)
    (tmp_path / "a" / CA_CERT_FILE).write_bytes(other.ca_pem())
    with pytest.raises(CAError, match="do not belong together"):
        load_or_create_ca(tmp_path / "a", KEYS)


def test_a_ca_directory_open_to_others_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "ca"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    with pytest.raises(CAError, match="chmod 700"):
        load_or_create_ca(directory, KEYS)
    assert not (directory / CA_KEY_FILE).exists()


def test_exporting_a_ca_that_does_not_exist_says_so(tmp_path: Path) -> None:
    with pytest.raises(CAError):
        ca_pem(tmp_path)


# --- leaves --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def leaves(tmp_path_factory: pytest.TempPathFactory) -> LeafCertificates:
    return LeafCertificates(load_or_create_ca(tmp_path_factory.mktemp("ca") / "ca", KEYS))


def _verify(leaves: LeafCertificates, cert: x509.Certificate, subject: x509.DNSName | x509.IPAddress) -> None:
    store = verification.Store([leaves._ca.cert])
    when = cert.not_valid_before_utc + timedelta(hours=2)
    verifier = verification.PolicyBuilder().store(store).time(when).build_server_verifier(subject)
    verifier.verify(cert, [])


def test_a_leaf_for_a_name_verifies_against_the_ca_for_that_name_only(leaves: LeafCertificates) -> None:
    cert = leaves.mint("Merchant.Test.")
    _verify(leaves, cert, x509.DNSName("merchant.test"))
    with pytest.raises(verification.VerificationError):
        _verify(leaves, cert, x509.DNSName("other.test"))


def test_a_leaf_for_an_ip_literal_carries_an_ip_address_name(leaves: LeafCertificates) -> None:
    cert = leaves.mint("[2001:db8::1]")
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("2001:db8::1")]
    assert san.get_values_for_type(x509.DNSName) == []
    _verify(leaves, cert, x509.IPAddress(ipaddress.ip_address("2001:db8::1")))


def test_leaves_are_short_lived_backdated_and_share_one_key(tmp_path: Path) -> None:
    clock = Clock()
    leaves = LeafCertificates(load_or_create_ca(tmp_path / "ca", KEYS), clock=clock)
    a, b = leaves.mint("a.example"), leaves.mint("b.example")
    assert a.public_key() == b.public_key() and a.serial_number != b.serial_number
    assert clock.now - timedelta(hours=2) < a.not_valid_before_utc < clock.now
    assert a.not_valid_after_utc - clock.now == timedelta(days=30)
    assert not a.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_a_leaf_is_refused_for_something_that_is_not_a_host(leaves: LeafCertificates) -> None:
    for bad in ("", "a b", "evil.com:443", "user@host", "2130706433"):
        with pytest.raises(ValueError):
            leaves.mint(bad)


def test_contexts_are_cached_per_host_evicted_least_recently_used_and_reminted_before_expiry(tmp_path: Path) -> None:
    clock = Clock()
    leaves = LeafCertificates(load_or_create_ca(tmp_path / "ca", KEYS), cache_size=2, clock=clock)
    a = leaves.context_for("a.example")
    assert leaves.context_for("A.EXAMPLE") is a
    b = leaves.context_for("b.example")
    leaves.context_for("a.example")
    leaves.context_for("c.example")  # evicts b, the least recently used
    assert leaves.context_for("a.example") is a
    assert leaves.context_for("b.example") is not b
    clock.now += timedelta(days=16)
    assert leaves.context_for("a.example") is not a


def _handshake(server_ctx: ssl.SSLContext, client_ctx: ssl.SSLContext, name: str | None) -> ssl.SSLObject:
    # Both ends in memory: a real TLS handshake with no socket.
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_ctx.wrap_bio(c_in, c_out, server_hostname=name)
    server = server_ctx.wrap_bio(s_in, s_out, server_side=True)
    done = {"client": False, "server": False}
    for _ in range(20):
        for side, obj, out, peer_in in (("client", client, c_out, s_in), ("server", server, s_out, c_in)):
            if not done[side]:
                try:
                    obj.do_handshake()
                    done[side] = True
                except ssl.SSLWantReadError:
                    pass
            peer_in.write(out.read())
        if all(done.values()):
            return server
    raise AssertionError("the handshake did not finish")


def test_a_client_trusting_the_ca_completes_a_handshake_and_the_server_learns_the_sni(
        leaves: LeafCertificates) -> None:
    client_ctx = ssl.create_default_context(cadata=leaves._ca.ca_pem().decode())
    server = _handshake(leaves.context_for("merchant.test"), client_ctx, "merchant.test")
    assert sni_of(server) == "merchant.test"
    assert server.selected_alpn_protocol() in (None, "http/1.1")


def test_a_client_asking_for_another_name_rejects_the_leaf(leaves: LeafCertificates) -> None:
    client_ctx = ssl.create_default_context(cadata=leaves._ca.ca_pem().decode())
    with pytest.raises(ssl.SSLCertVerificationError):
        _handshake(leaves.context_for("merchant.test"), client_ctx, "other.test")


def test_a_client_sending_no_sni_is_seen_as_sending_none(leaves: LeafCertificates) -> None:
    client_ctx = ssl.create_default_context(cadata=leaves._ca.ca_pem().decode())
    client_ctx.check_hostname = False
    assert sni_of(_handshake(leaves.context_for("merchant.test"), client_ctx, None)) is None


labels = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
names = st.lists(labels, min_size=1, max_size=4).map(lambda ls: ".".join([*ls, "example"]))


@given(names, st.booleans())
@settings(max_examples=40, deadline=None)
def test_a_minted_leaf_names_exactly_the_normalised_host(leaves: LeafCertificates, name: str, upper: bool) -> None:
    cert = leaves.mint(name.upper() if upper else name)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [name]
