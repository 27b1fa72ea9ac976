"""Repository text shown to people: bidirectional-override and terminal-control characters are
shown escaped, never raw.

A comment holding U+202E (RIGHT-TO-LEFT OVERRIDE) makes code read differently from how Python
runs it ("Trojan Source", CVE-2021-42574); an ESC byte in a file name or qualname could drive
the user's terminal. Everything npufuse prints or writes into a report from repository text
passes through :func:`escape_text`, and a report that had any of them says so at the top.
"""

from __future__ import annotations

import re

# bidi embeddings/overrides/isolates and marks, the Arabic letter mark, plus C0/C1 controls
# other than tab and newline (and carriage return, which CRLF files carry)
_BIDI = "\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069\u200e\u200f\u061c"
_UNSAFE = re.compile("[" + _BIDI + "\x00-\x08\x0b\x0c\x0e-\x1f\x7f\x80-\x9f" + "]")
_BIDI_SET = frozenset(_BIDI)

TROJAN_SOURCE_WARNING = (
    "warning: the repository text shown here contains bidirectional-override or terminal-control "
    "characters (shown escaped, e.g. \\u202e); the code may read differently from how Python runs it "
    "(Trojan Source, CVE-2021-42574): review those lines"
)


def _escape(match: re.Match[str]) -> str:
    ch = match.group(0)
    return f"\\u{ord(ch):04x}" if ord(ch) > 0xFF else f"\\x{ord(ch):02x}"


def has_unsafe(text: str) -> bool:
    return _UNSAFE.search(text) is not None


def has_bidi(text: str) -> bool:
    return any(ch in _BIDI_SET for ch in text)


def escape_text(text: str) -> str:
    """``text`` with every bidi-control and terminal-control character written as ``\\uXXXX``
    / ``\\xXX`` (and lone surrogates from non-UTF-8 file names as ``\\udcXX``)."""
    if _UNSAFE.search(text):
        text = _UNSAFE.sub(_escape, text)
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def safe_report_text(text: str) -> str:
    """A whole rendered report made safe: unsafe characters escaped and, when there were any,
    :data:`TROJAN_SOURCE_WARNING` as the first line (as a Markdown quote)."""
    if not _UNSAFE.search(text):
        return text
    return f"> **{TROJAN_SOURCE_WARNING}**\n\n" + escape_text(text)
