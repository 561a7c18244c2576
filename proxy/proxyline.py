"""The PROXY line (HAProxy's PROXY protocol, version 1, TCP4 only) a relayed connection begins with.

Tool computers on an isolated network on another host reach the egress proxy through the api's SSH tunnel to that
host (`vm.host_tunnel`), which hides their source address. The tunnel learns it from the host's sshd (the
`forwarded-tcpip` channel names its originator) and writes it ahead of the connection's bytes, on the proxy's relay
socket, which only the wakeful user can reach:

    PROXY TCP4 10.77.0.23 10.77.0.1 40112 3128\\r\\n

The proxy then knows the connection by that source address exactly as its address listener knows a direct one.
Read strictly: one line of at most `MAX_LINE` bytes ending in CRLF, single spaces, IPv4 addresses in their usual
form, decimal ports without leading zeros. `TCP6` and `UNKNOWN` are refused: the address book is IPv4, and a
connection that names no source would be nobody's.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["MAX_LINE", "MalformedProxyLine", "ProxyLine", "format_proxy_line", "parse_proxy_line"]

MAX_LINE: Final = 107
"""The longest line version 1 allows, CRLF included (a TCP4 line is at most 56)."""

_PORT = re.compile(r"0|[1-9][0-9]{0,4}")


class MalformedProxyLine(ValueError):
    """Not one strict TCP4 PROXY line. The message never quotes the bytes."""


@dataclass(frozen=True, kw_only=True)
class ProxyLine:
    source: str
    """The IPv4 address the connection came from: the tool computer's."""
    source_port: int
    destination: str
    """The address it connected to (the network's host address on its host)."""
    destination_port: int


def _address(text: str, what: str) -> str:
    try:
        address = ipaddress.IPv4Address(text)
    except ValueError:
        raise MalformedProxyLine(f"the {what} address is not an IPv4 address") from None
    if str(address) != text:
        raise MalformedProxyLine(f"the {what} address is not in its usual form")
    return text


def _port(text: str, what: str) -> int:
    if not _PORT.fullmatch(text) or int(text) > 65535:
        raise MalformedProxyLine(f"the {what} port is not a decimal number 0-65535")
    return int(text)


def parse_proxy_line(line: bytes) -> ProxyLine:
    """The line (CRLF included, nothing after it) as read from a relayed connection; `MalformedProxyLine` if not."""
    if len(line) > MAX_LINE:
        raise MalformedProxyLine(f"the PROXY line is longer than {MAX_LINE} bytes")
    if not line.endswith(b"\r\n") or b"\n" in line[:-1] or b"\r" in line[:-2]:
        raise MalformedProxyLine("not one line ending in CRLF")
    try:
        text = line[:-2].decode("ascii")
    except UnicodeDecodeError:
        raise MalformedProxyLine("the PROXY line is not ASCII") from None
    fields = text.split(" ")
    if fields[:1] != ["PROXY"]:
        raise MalformedProxyLine("the line does not begin with PROXY")
    if fields[1:2] != ["TCP4"]:
        raise MalformedProxyLine("only TCP4 is taken: the connection must name its IPv4 source")
    if len(fields) != 6:
        raise MalformedProxyLine("a TCP4 line has source, destination, source port and destination port")
    _, _, source, destination, source_port, destination_port = fields
    return ProxyLine(source=_address(source, "source"), destination=_address(destination, "destination"),
                     source_port=_port(source_port, "source"), destination_port=_port(destination_port,
                                                                                      "destination"))


def format_proxy_line(line: ProxyLine) -> bytes:
    """The line to write ahead of a relayed connection; `ValueError` for anything `parse_proxy_line` would refuse."""
    written = (f"PROXY TCP4 {line.source} {line.destination} {line.source_port} "
               f"{line.destination_port}\r\n").encode("ascii")
    if parse_proxy_line(written) != line:
        raise ValueError("the addresses are not IPv4 in their usual form")
    return written
