"""Where each key of a TOML text is: tomllib reports no positions, and a configuration error should name its line."""

from __future__ import annotations

import contextlib
import re
import tomllib

__all__ = ["Key", "TomlLines"]

Key = tuple[str | int, ...]


class TomlLines:
    """The line each key path of a TOML text starts on; tomllib reports no positions, so we scan.

    Lenient (it runs on text tomllib accepted, or stops quietly): it follows `[tables]`, `[[arrays of tables]]`,
    dotted keys, inline tables and arrays (elements are indexed), and skips strings and comments."""

    def __init__(self, text: str) -> None:
        self.text, self.pos, self.line = text, 0, 1
        self.at: dict[Key, int] = {}
        self._arrays: dict[Key, int] = {}
        with contextlib.suppress(IndexError, ValueError, tomllib.TOMLDecodeError):
            self._document()

    def line_of(self, key: Key) -> int | None:
        """The line of `key`, else of its deepest declared parent (a missing key is reported at its table)."""
        for end in range(len(key), 0, -1):
            if key[:end] in self.at:
                return self.at[key[:end]]
        return None

    def _mark(self, key: Key) -> None:
        for end in range(1, len(key)):
            self.at.setdefault(key[:end], self.line)
        self.at[key] = self.line

    def _document(self) -> None:
        table: Key = ()
        while True:
            self._skip(newlines=True)
            if self.pos >= len(self.text):
                return
            if self.text.startswith("[[", self.pos):
                self.pos += 2
                array = self._resolve(self._key())
                self.pos += 2
                self._arrays[array] = self._arrays.get(array, 0) + 1
                table = (*array, self._arrays[array] - 1)
                self._mark(table)
            elif self.text[self.pos] == "[":
                self.pos += 1
                table = self._resolve(self._key())
                self.pos += 1
                self._mark(table)
            else:
                self._assignment(table)

    def _resolve(self, key: tuple[str, ...]) -> Key:
        """A header's key with the current index of each array of tables it passes through."""
        out: list[str | int] = []
        for part in key[:-1]:
            out.append(part)
            if tuple(out) in self._arrays:
                out.append(self._arrays[tuple(out)] - 1)
        return (*out, key[-1])

    def _assignment(self, prefix: Key) -> None:
        key = (*prefix, *self._key())
        if self.text[self.pos] != "=":
            raise ValueError("expected =")
        self.pos += 1
        self._mark(key)
        self._value(key)

    def _key(self) -> tuple[str, ...]:
        parts: list[str] = []
        while True:
            self._skip(newlines=False)
            if self.text[self.pos] in "\"'":
                start = self._string()
                parts.append(str(tomllib.loads(f"k = {self.text[start:self.pos]}")["k"]))
            else:
                bare = re.compile(r"[A-Za-z0-9_-]+").match(self.text, self.pos)
                if bare is None:
                    raise ValueError("expected a key")
                parts.append(bare[0])
                self.pos = bare.end()
            self._skip(newlines=False)
            if self.text[self.pos] != ".":
                return tuple(parts)
            self.pos += 1

    def _value(self, key: Key) -> None:
        self._skip(newlines=False)
        opening = self.text[self.pos]
        if opening in "{[":
            self.pos += 1
            index = 0
            while True:
                self._skip(newlines=True)
                char = self.text[self.pos]
                if char in "}]":
                    self.pos += 1
                    return
                if char == ",":
                    self.pos += 1
                elif opening == "{":
                    self._assignment(key)
                else:
                    self._mark((*key, index))
                    self._value((*key, index))
                    index += 1
        elif opening in "\"'":
            self._string()
        else:
            scalar = re.compile(r"[^,\]}\n#]+").match(self.text, self.pos)
            if scalar is None:
                raise ValueError("expected a value")
            self.pos = scalar.end()

    def _string(self) -> int:
        """Skip the string at pos (any of the four kinds); return where it started."""
        text, start = self.text, self.pos
        delim = next(d for d in ('"""', "'''", '"', "'") if text.startswith(d, start))
        i = start + len(delim)
        while not text.startswith(delim, i):
            if i >= len(text):
                raise ValueError("unterminated string")
            i += 2 if delim[0] == '"' and text[i] == "\\" else 1
        end = i + len(delim)
        while len(delim) == 3 and end < len(text) and text[end] == delim[0] and end - i < 5:
            end += 1  # a multi-line string may end with one or two of its own quotes
        self.line += text.count("\n", start, end)
        self.pos = end
        return start

    def _skip(self, *, newlines: bool) -> None:
        text = self.text
        while self.pos < len(text):
            char = text[self.pos]
            if char in " \t\r":
                self.pos += 1
            elif char == "#":
                end = text.find("\n", self.pos)
                self.pos = len(text) if end < 0 else end
            elif char == "\n" and newlines:
                self.pos += 1
                self.line += 1
            else:
                return
