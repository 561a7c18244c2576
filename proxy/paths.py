"""Request paths in one canonical form, so a path rule judges the path the upstream will act on.

A prefix rule means something only if no spelling of a path can be read inside the prefix by the rule and outside
it by the upstream. `normalize_path` decodes percent-escapes once, strictly (UTF-8 only, overlong forms and other
invalid sequences rejected), resolves dot segments (RFC 3986 §5.2.4, `%2e` included) and refuses what servers read
differently: encoded slashes and backslashes, a backslash, NUL and other controls, an escape that decodes to
another escape (double encoding), a dot segment with `;` parameters (`..;` is `..` to Java servers) or after an
empty segment (`//..` or `/;/..` climbs one level or two depending on whether the server merges slashes or drops
parameters), a `%` that starts no escape. Pure; no I/O.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["AmbiguousPath", "NormalPath", "normalize_path", "within"]

_ESCAPE: Final = re.compile(r"%([0-9A-Fa-f]{2})")
_BAD_PERCENT: Final = re.compile(r"%(?![0-9A-Fa-f]{2})")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f/\\]")


class AmbiguousPath(ValueError):
    """A path that servers may read in more than one way: never matched against a rule, never forwarded."""


@dataclass(frozen=True, slots=True)
class NormalPath:
    wire: str
    """The path to forward: dot segments resolved, every other segment exactly as the client encoded it."""
    decoded: str
    """The same path percent-decoded: what rules compare."""


def _decode(segment: str) -> str:
    raw = _ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), segment).encode("latin-1")
    try:
        text = raw.decode("utf-8")  # strict: overlong forms, surrogates and stray bytes are errors
    except UnicodeDecodeError:
        raise AmbiguousPath("the path's percent-escapes are not valid UTF-8 (overlong forms included)") from None
    if _CONTROL.search(text):
        raise AmbiguousPath("the path encodes a slash, a backslash or a control character")
    if _ESCAPE.search(text):
        raise AmbiguousPath("the path is percent-encoded twice")
    return text


@functools.lru_cache(maxsize=4096)  # pure, and every rule of every request compares a path
def normalize_path(path: str) -> NormalPath:
    """The canonical form of an origin-form path (no query). Raises `AmbiguousPath`."""
    if not isinstance(path, str) or not path.startswith("/"):
        raise AmbiguousPath("a path starts with /")
    if "\\" in path or _BAD_PERCENT.search(path) or not path.isascii():
        raise AmbiguousPath("the path holds a backslash, a bare %, or characters a URL does not")
    segments = path[1:].split("/")
    kept: list[tuple[str, str]] = []
    empty_before = False
    for index, raw in enumerate(segments):
        last = index == len(segments) - 1
        text = _decode(raw)
        name = text.split(";", 1)[0]
        if name in (".", ".."):
            if name != text:
                raise AmbiguousPath("a dot segment with parameters (`..;`)")
            if empty_before:
                raise AmbiguousPath("a dot segment after an empty one (`//..`)")
            if name == ".." and kept:
                kept.pop()
            if last:
                kept.append(("", ""))  # "/a/.." is "/", a directory
            continue
        if name == "" and not last:  # "//", or ";x" that a server dropping parameters reads as one
            empty_before = True
        kept.append((raw, text))
    return NormalPath(wire="/" + "/".join(r for r, _ in kept), decoded="/" + "/".join(t for _, t in kept))


def within(path: str, prefix: str) -> bool:
    """Whether the decoded `path` is `prefix` or under it, segment-wise (`/v1` holds `/v1/x`, not `/v1x`)."""
    return path == prefix or path.startswith(prefix if prefix.endswith("/") else prefix + "/")
