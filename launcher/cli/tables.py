"""The row tables of `launcher runs` and `launcher status`: one line per run, whatever the width.

A terminal (or COLUMNS) gives the width: columns the command names as optional are left out while the
table would be wider (said in one line under it), then the widest cells are cut with an ellipsis (a
run id never: it is what users copy). Piped with COLUMNS unset, nothing is left out or cut: every row
is one line of every column, to grep or copy.
"""
from __future__ import annotations

import os
import sys
from typing import Any, List, Optional, Sequence, Tuple

from rich.cells import cell_len
from rich.text import Text

UNCUT = ("run_id",)  # never cut: what users copy into show / diff / reproduce
NARROWEST = 4  # a cut cell keeps this many cells (3 characters and the ellipsis)


def console() -> Any:
    """Rich's console: the terminal's width (or COLUMNS'); no width limit where the output is not a
    terminal and COLUMNS is unset (a pipe or a file keeps every column whole)."""
    from rich.console import Console  # rich: only the commands that print load it, not `launcher --help`

    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=100_000)


def one_line_table(header: Sequence[str], rows: Sequence[Sequence[Any]], width: int,
                   optional: Sequence[str] = (), right: Sequence[str] = ()) -> Tuple[Any, List[str]]:
    """A rich Table of ``rows`` (cells as text) with one line per row within ``width`` cells, and the
    names of the columns left out for it: the ``optional`` ones, in that order, while it is wider; then
    the widest cells (but the run id's) cut with an ellipsis. ``right``: columns justified right."""
    from rich.table import Column, Table  # rich: only the commands that print load it, not `launcher --help`

    texts = [[str(c) for c in row] for row in rows]
    keep = list(range(len(header)))
    widths = [max([cell_len(header[i])] + [cell_len(r[i]) for r in texts]) for i in keep]

    def total() -> int:  # a heavy-head box: 1 cell of padding each side and a rule between columns
        return sum(widths[i] for i in keep) + 3 * len(keep) + 1

    dropped: List[str] = []
    for name in optional:
        if total() <= width:
            break
        if name in header:
            keep.remove(header.index(name))
            dropped.append(name)
    while total() > width:
        cuttable = [i for i in keep if header[i] not in UNCUT and widths[i] > NARROWEST]
        if not cuttable:
            break
        widest = max(cuttable, key=lambda i: widths[i])
        widths[widest] -= min(widths[widest] - NARROWEST, total() - width)
    table = Table(*(Column(header[i], width=widths[i], no_wrap=True, overflow="ellipsis",
                           justify="right" if header[i] in right else "left") for i in keep))
    for row in texts:
        table.add_row(*(Text(row[i]) for i in keep))
    return table, dropped


def left_out_line(dropped: Sequence[str], width: int, more: Optional[str] = None) -> Optional[Text]:
    """The line under a table that left columns out (None: none left out)."""
    if not dropped:
        return None
    return Text(f"(at {width} columns without {', '.join(dropped)}: {more or '--json'})", style="dim")
