"""Text from a sandbox made safe to print on a terminal.

A sandbox's bytes are hostile, and a terminal obeys what it prints: ``ESC [2J`` clears the
screen, ``ESC ]0;...BEL`` sets the window title, ``\\r`` rewinds a line so a forged one
covers the real one, some terminals answer queries by typing into the shell. Everything
vf-sandbox prints that quotes a sandbox (the ``vf-sandbox`` command's messages and tables,
``inspect sandbox cleanup vf``'s lines) goes through :func:`terminal_safe` first.
"""

from __future__ import annotations

__all__ = ["terminal_safe"]

# bidi controls and line/paragraph separators: text that reads otherwise than it is
_INVISIBLE = (
    0x061C,
    0x200E,
    0x200F,
    *range(0x202A, 0x202F),
    *range(0x2066, 0x206A),
    0x2028,
    0x2029,
)


def _escapes(keep: str) -> dict[int, str]:
    table: dict[int, str] = {}
    for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]:
        table[code] = f"\\x{code:02x}"
    for code in _INVISIBLE:
        table[code] = f"\\u{code:04x}"
    for code in range(0xD800, 0xE000):  # lone surrogates (undecodable bytes, surrogateescape)
        table[code] = f"\\x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"\\u{code:04x}"
    for char in keep:
        del table[ord(char)]
    return table


_ESCAPES = _escapes("\n\t")


def terminal_safe(text: str) -> str:
    """``text`` with every control character escaped as ``\\xNN`` (C0 but newline and tab;
    DEL; C1; ESC included, so no terminal sequence survives),
    lone surrogates as the byte they stand for (``\\xNN``), and bidi controls and Unicode
    line separators as ``\\uNNNN``. Printable text, non-ASCII included, is unchanged."""
    return text.translate(_ESCAPES)
