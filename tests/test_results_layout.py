"""results/ is the current standing (targets-h100/, targets-h200/), the studies README.md and docs/*.md cite by
folder name, and INDEX.md, the index of every run ever committed (its header says how to restore a removed one)."""
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
STANDING = ("targets-h100", "targets-h200")


def _folders():
    return sorted(p.name for p in RESULTS.iterdir() if p.is_dir())


def _cited(name: str, text: str) -> bool:
    """Named as a whole folder name (not as the prefix of a longer one: h200-name-ab is not h200-name-ab-192)."""
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", text) is not None


def _index_rows() -> dict:
    """folder -> (bold, restore-from) from INDEX.md's table."""
    rows = {}
    for line in (RESULTS / "INDEX.md").read_text().splitlines():
        m = re.match(r"\|\s*(\*\*)?([\w.-]+?)(\*\*)?\s*\|", line)
        if m and not set(m.group(2)) <= {"-"} and m.group(2) != "folder":
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[m.group(2)] = (bool(m.group(1)), cells[-1])
    return rows


def test_every_folder_is_the_standing_or_a_cited_study():
    text = "\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    stray = [f for f in _folders() if f not in STANDING and not _cited(f, text)]
    assert not stray, (f"results/ keeps the current standing ({', '.join(STANDING)}) and the studies README.md or "
                       f"docs/*.md cite by folder name; cited nowhere: {stray}. Remove them (git rm -r) and mark "
                       f"their INDEX.md rows with the commit to restore them from")


def test_every_folder_records_its_environment():
    """Each run folder has the env.json its run wrote (GPU, driver, torch, triton, git commit) at its top."""
    missing = [f for f in _folders() if not (RESULTS / f / "env.json").is_file()]
    assert not missing, f"results folders without env.json: {missing}"
    for f in _folders():
        env = json.loads((RESULTS / f / "env.json").read_text())
        assert "triton" in env, f"results/{f}/env.json records no triton"


def test_index_has_a_row_for_every_folder_and_bolds_exactly_those_present():
    rows = _index_rows()
    folders = _folders()
    assert not [f for f in folders if f not in rows], "folders without an INDEX.md row"
    assert [f for f in folders if not rows[f][0]] == [], "present folders must be bold in INDEX.md"
    gone_but_bold = [name for name, (bold, _) in rows.items() if bold and name not in folders]
    assert not gone_but_bold, f"bold INDEX.md rows whose folder is gone: {gone_but_bold}"
    for name, (bold, restore) in rows.items():
        if not bold:  # a removed run names the commit it comes back from
            assert re.fullmatch(r"[0-9a-f]{7,40}", restore), f"INDEX.md row {name}: no commit to restore it from"
