"""The markup of `launcher report`'s pages (pure): ``Html`` (markup built here, inserted as it is) and
the helpers that build it (tags, tables, sections, embedded PNGs, the page with its inline CSS).

Every other value passes through ``esc``: text taken from the archive is user data.
"""
from __future__ import annotations

import base64
import html
import json
from typing import Any, Iterable, Optional, Sequence, Tuple

from launcher import sweeps

Plot = Tuple[str, bytes]  # (title, PNG bytes)

CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:1.5em auto;max-width:1200px;color:#222;
padding:0 1em}
h1{font-size:1.4em}h2{font-size:1.15em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1em}
table{border-collapse:collapse;margin:.5em 0;font-size:.9em}
th,td{border:1px solid #ccc;padding:.2em .5em;text-align:left;vertical-align:top}
th{background:#f3f3f3}
td.num{text-align:right;font-variant-numeric:tabular-nums}
pre{background:#f7f7f7;border:1px solid #ddd;padding:.5em;overflow:auto;max-height:40em;font-size:.85em}
.plots{display:flex;flex-wrap:wrap;gap:.5em}.plots figure{margin:0}
figcaption{font-size:.85em;color:#555}
.grid td{text-align:center;min-width:4em}
.status-completed{color:#176a1d}.status-failed,.status-timeout,.status-cancelled{color:#a31515}
.note{color:#666;font-size:.85em}
"""


class Html(str):
    """Markup this module built: inserted as it is. Anything else passes through ``esc``."""


def esc(value: Any) -> Html:
    if isinstance(value, Html):
        return value
    return Html(html.escape("" if value is None else str(value), quote=True))


def join(parts: Iterable[Any]) -> Html:
    return Html("".join(esc(p) for p in parts))


def tag(name: str, body: Any = "", **attrs: Any) -> Html:
    """<name attrs>body</name>; attribute values escaped (``cls`` is ``class``)."""
    a = "".join(f' {"class" if k == "cls" else k}="{esc(v)}"' for k, v in attrs.items() if v is not None)
    return Html(f"<{name}{a}>{esc(body)}</{name}>")


def table(headers: Optional[Sequence[Any]], rows: Iterable[Sequence[Any]], cls: Optional[str] = None,
          row_head: bool = False) -> Html:
    """A table (no header row when ``headers`` is None; ``row_head``: each row's first cell is its
    heading); numbers right-aligned, every cell escaped unless it is ``Html``."""
    def cell(i: int, v: Any) -> Html:
        if row_head and i == 0:
            return tag("th", _cell(v))
        return tag("td", _cell(v), cls="num" if is_num(v) else None)

    head = tag("tr", join(tag("th", h) for h in headers)) if headers else ""
    body = join(tag("tr", join(cell(i, v) for i, v in enumerate(row))) for row in rows)
    return tag("table", Html(head + body), cls=cls)


def kv_table(pairs: Iterable[Tuple[Any, Any]]) -> Html:
    return table(None, pairs, row_head=True)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _cell(v: Any) -> Any:
    if isinstance(v, Html):
        return v
    if isinstance(v, float):
        return sweeps.fmt(v)
    if isinstance(v, (dict, list)):
        return json.dumps(v, sort_keys=True)
    return "" if v is None else v


def section(title: str, body: Any, anchor: Optional[str] = None) -> Html:
    return Html(tag("h2", title, id=anchor) + esc(body))


def details(summary: str, body: Any, open_: bool = False) -> Html:
    return tag("details", Html(tag("summary", summary) + esc(body)), open="open" if open_ else None)


def pre(text: Any) -> Html:
    return tag("pre", text)


def img(png: bytes, alt: str) -> Html:
    """A PNG embedded in the page (no file or URL to lose)."""
    data = base64.b64encode(png).decode("ascii")
    return Html(f'<img src="data:image/png;base64,{data}" alt="{esc(alt)}">')


def plots_block(plots: Sequence[Plot]) -> Html:
    figs = (tag("figure", Html(img(png, title) + tag("figcaption", title))) for title, png in plots)
    return tag("div", join(figs), cls="plots")


def page(title: str, body: Iterable[Any]) -> str:
    return ("<!DOCTYPE html>\n" + tag("html", Html(
        tag("head", Html('<meta charset="utf-8">' + tag("title", title) + tag("style", Html(CSS))))
        + tag("body", Html(tag("h1", title) + join(body)))), lang="en") + "\n")


def status_span(status: Any) -> Html:
    return tag("span", status or "unknown", cls=f"status-{status}" if status else None)


def fmt_bytes(n: Any) -> str:
    return "" if not is_num(n) else f"{n / 2**20:,.2f} MiB"


def fmt_pct(x: Optional[float]) -> str:
    return "" if x is None else f"{x * 100:+.1f}%"
