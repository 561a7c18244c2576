"""Which tool computer speaks from which address on the isolated network: the proxy's side of the address book.

The VM manager writes `{"version": 1, "addresses": {"10.77.0.23": {"user_id": …, "token": …}, …}}` and replaces the
file by rename; libvirt's `clean-traffic` filter keeps a VM from sending from another's address. A connection on the
proxy's address listener is known by its source address alone (see `ProxyConfig.address_listen`).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
from pathlib import Path
from typing import Any, Final

from wakeful.proxy.wire import ANONYMOUS, Identity

__all__ = ["AddressBook", "normalize_address"]

log = logging.getLogger("wakeful.proxy")

_VERSION: Final = 1
_LIMIT: Final = 256

_Stamp = tuple[int, int, int] | None


class _Malformed(ValueError):
    """The file is not an address book. Its message never quotes a token."""


def normalize_address(address: str) -> str | None:
    """The IPv4 address a peer address names (`::ffff:10.77.0.23` → `10.77.0.23`); None for anything else."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    v4 = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else ip  # None unless IPv4-mapped
    return str(v4) if v4 is not None else None


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise _Malformed("a key appears twice")
    return dict(pairs)


def _text(value: object, what: str, address: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= _LIMIT or not value.isprintable():
        raise _Malformed(f"the {what} of {address} is not a printable string of 1-{_LIMIT} characters")
    return value


def _parse(data: bytes) -> dict[str, Identity]:
    try:
        document = json.loads(data, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:  # their messages give a position, not the text
        raise _Malformed(f"not JSON ({exc})") from None
    if not isinstance(document, dict) or document.get("version") != _VERSION:
        raise _Malformed(f'not an object with "version": {_VERSION}')
    addresses = document.get("addresses")
    if not isinstance(addresses, dict):
        raise _Malformed('"addresses" is not an object')
    book: dict[str, Identity] = {}
    for key, entry in addresses.items():
        address = normalize_address(key)
        if address is None or address != key:
            raise _Malformed(f"{key!r} is not an IPv4 address in its usual form")
        if not isinstance(entry, dict) or set(entry) != {"user_id", "token"}:
            raise _Malformed(f'the entry of {address} is not {{"user_id": …, "token": …}}')
        user_id = _text(entry["user_id"], "user_id", address)
        if ":" in user_id:  # Basic credentials split at the first colon: such a user could never present itself
            raise _Malformed(f"the user_id of {address} holds a colon")
        book[address] = Identity(user_id=user_id, token=_text(entry["token"], "token", address))
    return book


class AddressBook:
    """The identities of tool computers by their IPv4 address, re-read whenever the file changes.

    Fails closed: an address not in the book, a missing file and a malformed one all give `ANONYMOUS`, which the
    decider refuses. A missing or malformed file is logged once per change of the file, never with a token."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: _Stamp = None
        self._read = False
        self._book: dict[str, Identity] = {}

    def __repr__(self) -> str:  # the identities hold tokens: only the count is shown
        return f"AddressBook({str(self.path)!r}, {len(self._book)} addresses)"

    def identity(self, address: str) -> Identity:
        """Who speaks from `address` (a peer address as the socket reports it); `ANONYMOUS` when nobody known."""
        self._refresh()
        normalized = normalize_address(address)
        return self._book.get(normalized, ANONYMOUS) if normalized is not None else ANONYMOUS

    def _refresh(self) -> None:
        try:
            st = os.stat(self.path)
            stamp: _Stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            stamp = None
        if self._read and stamp == self._stamp:
            return
        self._read, self._stamp, self._book = True, stamp, {}
        if stamp is None:
            log.warning("the address book %s cannot be read; every tool computer on the isolated network is "
                        "anonymous (and refused) until it is written", self.path)
            return
        try:
            with open(self.path, "rb") as file:
                st = os.fstat(file.fileno())
                self._stamp = (st.st_mtime_ns, st.st_size, st.st_ino)  # what was read, should it have been replaced
                data = file.read()
        except OSError as exc:  # kept as read: warned once, tried again when the file changes
            log.warning("the address book %s cannot be read (%s); every tool computer on the isolated network is "
                        "anonymous (and refused) until it is fixed", self.path, type(exc).__name__)
            return
        try:
            self._book = _parse(data)
        except _Malformed as exc:
            log.warning("the address book %s is malformed: %s; every tool computer on the isolated network is "
                        "anonymous (and refused) until it is rewritten", self.path, exc)
            return
        log.info("the address book %s names %d tool computers", self.path, len(self._book))
