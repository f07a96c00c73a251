"""The docs' links into docs/benchmarks.md land on something, and that page stays a page of
current figures (each with its command), not a log."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "docs" / "benchmarks.md"

# A Markdown link whose target is benchmarks.md with an anchor, from README.md (docs/benchmarks.md)
# or from docs/*.md (benchmarks.md).
_LINK = re.compile(r"\]\((?:docs/)?benchmarks\.md#([^)\s]+)\)")
_HTML_ANCHOR = re.compile(r'<a id="([^"]+)"></a>')


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than hyphens and
    underscores dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every anchor a page offers: its headings' slugs and its explicit ``<a id>`` anchors."""
    found = set(_HTML_ANCHOR.findall(markdown))
    for line in markdown.splitlines():
        if line.startswith("#"):
            found.add(_slug(line.lstrip("#")))
    return found


def links_into_benchmarks() -> list[tuple[str, str]]:
    """(file, anchor) of each link to docs/benchmarks.md#anchor in README.md and docs/*.md."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    return [(f.relative_to(ROOT).as_posix(), a) for f in files for a in _LINK.findall(f.read_text(encoding="utf-8"))]


def test_every_link_into_the_benchmarks_page_resolves() -> None:
    offered = anchors(BENCHMARKS.read_text(encoding="utf-8"))
    links = links_into_benchmarks()
    assert links, "no links found: the pattern no longer matches the docs"
    broken = [f"{f}: #{a}" for f, a in links if a not in offered]
    assert not broken, "links to anchors docs/benchmarks.md does not have:\n" + "\n".join(broken)


def test_the_anchor_finder_sees_headings_and_row_anchors() -> None:
    page = '# Benchmarks\n### Per-request path\n| <a id="sdk-worker"></a>SDK → worker | 0.8× |\n'
    assert anchors(page) >= {"benchmarks", "per-request-path", "sdk-worker"}
    assert _slug("The per-request hot path *(2026-12)*") == "the-per-request-hot-path-2026-12"


def test_every_figure_on_the_benchmarks_page_has_a_command_and_a_date() -> None:
    """A product page: one row a figure, each with the command that reproduces it and when it
    was measured, on a few screens."""
    text = BENCHMARKS.read_text(encoding="utf-8")
    assert len(text.splitlines()) < 250
    rows = [line for line in text.splitlines() if line.startswith("| <a id=")]
    assert len(rows) >= 20
    for row in rows:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]]
        assert len(cells) == 5, row
        _, figure, _, command, date = cells
        assert figure and ("python -m bench." in command or "the same" in command or "above" in command or "stress loop" in command), row
        assert re.search(r"\b20\d\d\b", date), row
