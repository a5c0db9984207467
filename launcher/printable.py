"""Archived text made safe to print on a terminal: a rank's error or log line may hold ESC/OSC
sequences (colours, a window title, a clipboard write) that a terminal would obey. A leaf module.

Every control character but the kept ones (newline and tab) is written as its escape (``\\x1b``,
``\\x9b``), so the text still shows what was there and nothing reaches the terminal raw."""
from __future__ import annotations

import re
from functools import lru_cache

# C0 controls, DEL and the C1 controls (U+0080-U+009F: 8-bit CSI, OSC ... that some terminals obey)
_CONTROLS = "".join(chr(c) for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)))


@lru_cache(maxsize=4)
def _pattern(keep: str) -> re.Pattern:
    return re.compile("[" + re.escape("".join(c for c in _CONTROLS if c not in keep)) + "]")


def printable(text: object, keep: str = "\n\t") -> str:
    """``text`` (str() of it) with every control character not in ``keep`` escaped as ``\\xNN``."""
    return _pattern(keep).sub(lambda m: f"\\x{ord(m.group()):02x}", str(text))
