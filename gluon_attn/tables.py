"""Terminal tables: rich when installed, plain text otherwise."""
from __future__ import annotations

from typing import Optional, Sequence


def render_table(rows: Sequence[dict], title: Optional[str] = None, plain: bool = False) -> str:
    if not rows:
        return f"{title}: (empty)" if title else "(empty)"
    columns = list(rows[0])
    if not plain:
        try:
            import io

            from rich.console import Console
            from rich.table import Table
            from rich.text import Text
        except ImportError:
            plain = True
    if plain:
        widths = {c: max(len(str(c)), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
        lines = [title] if title else []
        lines.append("  ".join(f"{c:<{widths[c]}}" for c in columns))
        lines.append("  ".join("-" * widths[c] for c in columns))
        lines += ["  ".join(f"{str(r.get(c, '')):<{widths[c]}}" for c in columns) for r in rows]
        return "\n".join(lines)
    table = Table()
    for c in columns:
        table.add_column(str(c), justify="right" if isinstance(rows[0].get(c), (int, float)) else "left")
    for r in rows:
        table.add_row(*(Text(str(r.get(c, ""))) for c in columns))  # Text: no markup ("[peers]" stays)
    buf = io.StringIO()
    Console(file=buf, width=200, force_terminal=False, color_system=None).print(table)
    body = buf.getvalue().rstrip()
    return f"{title}\n{body}" if title else body


FORMATS = ("table", "md", "csv", "json")


def render(rows: Sequence[dict], fmt: str = "table", title: Optional[str] = None) -> str:
    """Rows as a terminal table (rich when installed, plain text otherwise), Markdown, CSV or JSON."""
    rows = [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]
    if fmt == "json":
        import json
        return json.dumps(rows, indent=2, default=str)
    if fmt == "csv":
        import csv
        import io
        if not rows:
            return ""
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
        return buf.getvalue().rstrip()
    if fmt == "md":
        if not rows:
            return "(no rows)"
        cols = list(rows[0])
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
        return ((f"**{title}**\n\n" if title else "") + "\n".join(lines))
    if fmt == "table":
        return render_table(rows, title=title)
    raise ValueError(f"unknown format {fmt!r}; supported: {', '.join(FORMATS)}")
