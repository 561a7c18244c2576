"""The address book: who speaks from which address on the isolated network, failing closed to ANONYMOUS."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from wakeful.proxy.addressbook import AddressBook, normalize_address
from wakeful.proxy.config import ProxyConfig
from wakeful.proxy.vault import KeyRing, Vault, generate_key
from wakeful.proxy.wire import ANONYMOUS, Identity

TOKEN_A = "tok_canary_a_5d1f0c"
TOKEN_B = "tok_canary_b_93e2aa"


def write_book(path: Path, addresses: dict[str, Any] | None = None, *, raw: str | None = None) -> None:
    """As the VM manager does: a temporary file renamed over the book."""
    text = raw if raw is not None else json.dumps({"version": 1, "addresses": addresses or {}})
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "address-book.json"


def test_a_booked_address_is_known_as_its_tool_computer(path: Path) -> None:
    write_book(path, {"10.77.0.23": {"user_id": "usr_a", "token": TOKEN_A},
                      "10.77.0.24": {"user_id": "usr_b", "token": TOKEN_B}})
    book = AddressBook(path)
    assert book.identity("10.77.0.23") == Identity(user_id="usr_a", token=TOKEN_A)
    assert book.identity("10.77.0.24") == Identity(user_id="usr_b", token=TOKEN_B)


def test_an_address_not_in_the_book_is_anonymous(path: Path) -> None:
    write_book(path, {"10.77.0.23": {"user_id": "usr_a", "token": TOKEN_A}})
    book = AddressBook(path)
    assert book.identity("10.77.0.99") is ANONYMOUS
    assert book.identity("not an address") is ANONYMOUS
    assert book.identity("fe80::1") is ANONYMOUS


def test_an_ipv4_mapped_peer_address_is_the_ipv4_one(path: Path) -> None:
    write_book(path, {"10.77.0.23": {"user_id": "usr_a", "token": TOKEN_A}})
    book = AddressBook(path)
    assert book.identity("::ffff:10.77.0.23") == Identity(user_id="usr_a", token=TOKEN_A)
    assert normalize_address("::ffff:a4d:17") == "10.77.0.23"
    assert normalize_address("::1") is None


def test_a_missing_book_makes_everyone_anonymous_with_one_warning(
        path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="wakeful.proxy")
    book = AddressBook(path)
    assert book.identity("10.77.0.23") is ANONYMOUS
    assert book.identity("10.77.0.23") is ANONYMOUS
    assert [r.levelno for r in caplog.records] == [logging.WARNING]


@pytest.mark.parametrize("raw", [
    "{not json",
    json.dumps({"version": 2, "addresses": {}}),
    json.dumps({"version": 1, "addresses": []}),
    json.dumps({"version": 1, "addresses": {"10.77.0.300": {"user_id": "usr_a", "token": TOKEN_A}}}),
    json.dumps({"version": 1, "addresses": {"10.77.0.23": {"user_id": "usr_a"}}}),
    json.dumps({"version": 1, "addresses": {"10.77.0.23": {"user_id": "usr_a", "token": TOKEN_A + "\n"}}}),
    json.dumps({"version": 1, "addresses": {"10.77.0.23": {"user_id": "usr:a", "token": TOKEN_A}}}),
    f'{{"version": 1, "addresses": {{"10.77.0.23": {{"user_id": "usr_a", "token": "{TOKEN_A}"}}, '
    f'"10.77.0.23": {{"user_id": "usr_b", "token": "{TOKEN_B}"}}}}}}',
], ids=["not-json", "version", "addresses-list", "bad-address", "no-token", "unprintable-token", "colon-in-user",
        "duplicate-address"])
def test_a_malformed_book_makes_everyone_anonymous_with_one_warning_and_no_token(
        path: Path, raw: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="wakeful.proxy")
    write_book(path, raw=raw)
    book = AddressBook(path)
    assert book.identity("10.77.0.23") is ANONYMOUS
    assert book.identity("10.77.0.23") is ANONYMOUS
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert TOKEN_A not in caplog.text and TOKEN_B not in caplog.text


def test_a_rewritten_book_is_read_again_so_new_computers_are_known_and_destroyed_ones_forgotten(
        path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="wakeful.proxy")
    write_book(path, {"10.77.0.23": {"user_id": "usr_a", "token": TOKEN_A}})
    book = AddressBook(path)
    assert book.identity("10.77.0.23").user_id == "usr_a"
    write_book(path, {"10.77.0.24": {"user_id": "usr_b", "token": TOKEN_B}})
    assert book.identity("10.77.0.23") is ANONYMOUS
    assert book.identity("10.77.0.24").user_id == "usr_b"
    write_book(path, raw="{broken")
    assert book.identity("10.77.0.24") is ANONYMOUS
    write_book(path, {"10.77.0.23": {"user_id": "usr_b", "token": TOKEN_B}})  # the address now belongs to B
    assert book.identity("10.77.0.23") == Identity(user_id="usr_b", token=TOKEN_B)
    assert [r.levelno for r in caplog.records].count(logging.WARNING) == 1
    assert TOKEN_A not in caplog.text and TOKEN_B not in caplog.text


def test_an_unchanged_book_is_not_read_again(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_book(path, {"10.77.0.23": {"user_id": "usr_a", "token": TOKEN_A}})
    book = AddressBook(path)
    book.identity("10.77.0.23")
    opened: list[object] = []
    monkeypatch.setattr("wakeful.proxy.addressbook.open", lambda *a, **k: opened.append(a) or open(*a, **k),
                        raising=False)
    for _ in range(3):
        assert book.identity("10.77.0.23").user_id == "usr_a"
    assert opened == []


def test_no_token_is_in_any_repr(path: Path) -> None:
    write_book(path, {"10.77.0.23": {"user_id": "usr_a", "token": TOKEN_A}})
    book = AddressBook(path)
    identity = book.identity("10.77.0.23")
    for text in (repr(book), str(book), repr(identity), repr(book.__dict__)):
        assert TOKEN_A not in text


def test_the_address_listener_and_its_book_go_together(tmp_path: Path) -> None:
    keys = KeyRing(current=generate_key())
    base: dict[str, Any] = {"decider_socket": tmp_path / "d.sock", "decider_token": "t", "ca_dir": tmp_path,
                            "keys": keys, "vault": Vault(tmp_path / "vault.json", keys)}
    with pytest.raises(ValueError, match="go together"):
        ProxyConfig(**base, address_listen=("10.77.0.1", 3128))
    with pytest.raises(ValueError, match="go together"):
        ProxyConfig(**base, address_book=tmp_path / "address-book.json")
    config = ProxyConfig(**base, address_listen=("10.77.0.1", 3128), address_book=tmp_path / "address-book.json")
    assert config.address_listen == ("10.77.0.1", 3128)
