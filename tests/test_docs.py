"""The documentation builds and its links hold: `mkdocs build --strict` of mkdocs.yml (the docs/ site, theme
material) passes, every relative link of README.md and docs/*.md names a file that exists (and, with a `#anchor`
into a page, a heading of that page), and mkdocs.yml's nav lists every page. Fast tier: one mkdocs build, ~2 s."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import REPO

DOCS = REPO / "docs"


def test_mkdocs_build_strict(tmp_path):
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=REPO,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    assert (site / "index.html").is_file()


def _nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    items = nav.values() if isinstance(nav, dict) else nav
    return [page for item in items for page in _nav_pages(item)]


def test_nav_lists_every_page():
    nav = _nav_pages(yaml.safe_load((REPO / "mkdocs.yml").read_text())["nav"])
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert sorted(nav) == pages, f"mkdocs.yml nav {sorted(nav)} vs docs/ {pages}"


def _without_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans (a `[x](y)` there is not a link)."""
    return re.sub(r"`[^`\n]*`", "", _without_fences(text))


def _anchors(page: Path) -> set[str]:
    """The heading ids of a page as mkdocs' toc extension makes them (and GitHub does, for these headings)."""
    from markdown.extensions.toc import slugify

    headings = re.findall(r"^#{1,6}\s+(.*?)\s*#*\s*$", _without_fences(page.read_text()), flags=re.M)
    return {slugify(h.replace("`", ""), "-") for h in headings}


def test_every_relative_link_points_at_a_file():
    broken = []
    for source in [REPO / "README.md", *sorted(DOCS.glob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", _prose(source.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: …
                continue
            path, _, anchor = target.partition("#")
            file = (source.parent / path).resolve() if path else source
            if not file.exists():
                broken.append(f"{source.relative_to(REPO)}: {target} (no file {path})")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
                broken.append(f"{source.relative_to(REPO)}: {target} (no heading #{anchor} in {path or source.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)
