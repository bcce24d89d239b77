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
        table.add_row(*(str(r.get(c, "")) for c in columns))
    buf = io.StringIO()
    Console(file=buf, width=120, force_terminal=False, color_system=None).print(table)
    body = buf.getvalue().rstrip()
    return f"{title}\n{body}" if title else body
