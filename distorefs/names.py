"""Validation of the names users give to entries and namespaces (DESIGN.md §2, Errors)."""

from __future__ import annotations

import re

from .errors import InvalidArgument, InvalidName, NameTooLong

MAX_NAME_BYTES = 255


def check_name(name: bytes) -> bytes:
    """Return `name` if it is a valid single path component, else raise InvalidName (EINVAL;
    NameTooLong, ENAMETOOLONG, past 255 bytes)."""
    if not name:
        raise InvalidName("empty name")
    if len(name) > MAX_NAME_BYTES:
        raise NameTooLong(f"name longer than {MAX_NAME_BYTES} bytes ({len(name)})")
    if name in (b".", b".."):
        raise InvalidName(f"reserved name {name!r}")
    if b"/" in name or b"\0" in name:
        raise InvalidName(f"name contains '/' or NUL: {name!r}")
    return name


def check_namespace_name(name: str) -> str:
    """A namespace name (buffers/NAME, banks/NAME, datasets/NAME): a valid component that is
    UTF-8 (it is stored as text and shown in stats and metrics). InvalidName otherwise;
    `name` comes from bytes decoded with surrogateescape, so non-UTF-8 shows as surrogates."""
    try:
        raw = name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidName(f"namespace name is not UTF-8: {name.encode('utf-8', 'surrogateescape')!r}") from None
    check_name(raw)
    return name


# Keys in the line formats of `sample/N` and `priorities` ("KEY ..." lines): a key may hold
# any byte but `/` and NUL, so a space, a tab, a newline or a backslash in it is written as
# a backslash and three octal digits (as /proc/mounts does), and read back the same way;
# a key can then neither split a line nor inject one.
_ESCAPED = frozenset(b" \t\n\r\\\x0b\x0c")
_NEEDS_ESCAPE = re.compile(rb"[ \t\n\r\\\x0b\x0c]")


def escape_key(key: bytes) -> bytes:
    """`key` as it appears in a line of `sample/N` or `priorities`."""
    if _NEEDS_ESCAPE.search(key) is None:  # the common case, at C speed
        return key
    return b"".join(b"\\%03o" % c if c in _ESCAPED else bytes((c,)) for c in key)


def escape_keys(keys: list[bytes]) -> list[bytes]:
    """`escape_key` of each of `keys`: one search over them all (a key holds no `/`), as
    most batches have no key to escape."""
    if _NEEDS_ESCAPE.search(b"/".join(keys)) is None:
        return keys
    return [escape_key(k) for k in keys]


def unescape_key(text: bytes) -> bytes:
    """The key a `sample/N` or `priorities` line names (see escape_key); a backslash not
    followed by three octal digits stands for itself."""
    if b"\\" not in text:
        return text
    out = bytearray()
    i = 0
    while i < len(text):
        c = text[i]
        digits = text[i + 1:i + 4]
        if c == 0x5C and len(digits) == 3 and all(0x30 <= d <= 0x37 for d in digits) and int(digits, 8) < 256:
            out.append(int(digits, 8))
            i += 4
        else:
            out.append(c)
            i += 1
    return bytes(out)


def parse_priorities(text: bytes) -> list[tuple[bytes, float]]:
    """(key, priority) of each "KEY PRIORITY" line; InvalidArgument naming the first bad line."""
    if b"#" not in text and b"\\" not in text:
        # The usual text - no comments, no escaped keys, one pair per line - in a few
        # C-speed calls; anything else (and any error) takes the line-by-line way below.
        tokens = text.split()
        lines = text.count(b"\n") + (0 if text.endswith(b"\n") else 1)
        if len(tokens) == 2 * lines:
            try:
                return list(zip(tokens[0::2], map(float, tokens[1::2])))
            except ValueError:
                pass
    pairs = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(b"#"):
            continue
        parts = line.rsplit(None, 1)
        if len(parts) != 2:
            raise InvalidArgument(f"priorities line {number}: expected 'KEY PRIORITY', got {line[:80]!r}")
        try:
            value = float(parts[1])
        except ValueError:
            raise InvalidArgument(f"priorities line {number}: bad priority {parts[1][:40]!r}") from None
        pairs.append((unescape_key(parts[0]), value))
    return pairs
