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
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
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
    for source in [REPO / "README.md", REPO / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]:
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


# ----------------------------------------------------------------------------------------------------------------
# The generated reference: every key described, the pages current, --help listing every key
# ----------------------------------------------------------------------------------------------------------------


def test_every_recipe_key_has_a_description():
    from neox_hf.recipe.reference import recipe_keys, undescribed_keys

    assert len(recipe_keys()) > 100
    assert undescribed_keys() == [], "recipe fields without metadata={'help': ...}: " + ", ".join(undescribed_keys())


def test_the_neox_column_names_every_key_the_translation_maps_there():
    """neox_yaml's one-to-one table (GPT-NeoX key → recipe key) and the fields' `neox` metadata agree."""
    from neox_hf.neox_yaml import _DIRECT
    from neox_hf.recipe.reference import recipe_keys

    neox_of = {k.name: {n.strip() for n in k.neox.split(",")} for k in recipe_keys()}
    missing = [f"{path} lacks {key}" for key, (path, _) in _DIRECT.items() if key not in neox_of[path]]
    assert not missing, missing


def test_every_cli_option_has_help_text():
    import argparse

    from neox_hf.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bare = [f"neox_hf {name} {action.option_strings or action.dest}" for name, parser in sub.choices.items()
            for action in parser._actions if not (action.help or "").strip()]
    assert not bare, bare


def test_generated_reference_pages_are_current():
    sys.path.insert(0, str(REPO / "tools"))
    from generate_docs import stale_pages

    stale = [str(p.relative_to(REPO)) for p in stale_pages()]
    assert not stale, f"regenerate with `python tools/generate_docs.py`: {stale}"


def test_train_help_lists_every_recipe_key(capsys):
    from neox_hf.cli import train_main
    from neox_hf.recipe.reference import recipe_keys

    assert train_main(["--help"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("usage: run_clm_neox.py RECIPE.yaml")
    absent = [k.name for k in recipe_keys() if k.type != "mapping" and "[]" not in k.name
              and f"--{k.name} " not in printed]
    assert not absent, absent


# ----------------------------------------------------------------------------------------------------------------
# Readability: short sentences, short bullets, no history or issue numbers on user pages
# ----------------------------------------------------------------------------------------------------------------

MAX_MEAN_SENTENCE_WORDS = 25  # accelerate's docs average 15-20
MAX_BULLET_WORDS = 80


def _readable_text(text: str) -> str:
    """A page's prose: no code blocks, HTML comments or tags, headings or table rows; a code span counts as one
    word and a link as its text."""
    text = _without_fences(text)
    text = re.sub(r"<!--.*?-->", " ", text, flags=re.S)
    text = re.sub(r"<[^>]+>", " ", text)
    lines = [line for line in text.splitlines() if not line.lstrip().startswith(("|", "#"))]
    text = re.sub(r"``.*?``|`[^`\n]*`", "CODE", "\n".join(lines))
    return re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)


def _blocks(text: str) -> list[tuple[bool, str]]:
    """(is a bullet, its text) for each paragraph and each list item."""
    blocks = re.split(r"\n\s*\n|\n(?=\s*(?:[-*]|\d+\.) )", _readable_text(text))
    return [(bool(re.match(r"\s*(?:[-*]|\d+\.) ", b)), " ".join(b.split())) for b in blocks if b.strip()]


def _words(text: str) -> int:
    return len(re.findall(r"\w[\w'’./-]*", text))


def sentence_lengths(text: str) -> list[int]:
    """Words per sentence; a sentence ends at . ! ? or ; followed by a space (a semicolon joins two sentences)."""
    lengths = []
    for _, block in _blocks(text):
        lengths += [n for n in map(_words, re.split(r"(?<=[.!?;])\s+", block)) if n]
    return lengths


def user_pages() -> list[Path]:
    return [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]


def test_every_page_has_short_sentences_and_bullets():
    long_pages, long_bullets = [], []
    for page in user_pages():
        text = page.read_text()
        lengths = sentence_lengths(text)
        if lengths and sum(lengths) / len(lengths) > MAX_MEAN_SENTENCE_WORDS:
            long_pages.append(f"{page.relative_to(REPO)}: {sum(lengths) / len(lengths):.1f} words per sentence")
        long_bullets += [f"{page.relative_to(REPO)}: {_words(b)} words: {b[:80]}…" for is_bullet, b in _blocks(text)
                         if is_bullet and _words(b) > MAX_BULLET_WORDS]
    assert not long_pages and not long_bullets, "\n".join(long_pages + long_bullets)


def test_user_pages_name_no_issues_and_keep_history_in_the_changelog():
    """No issue numbers, history or test files on a user page: a proof worth keeping says what is checked, in a
    `??? note` block, without the file that checks it."""
    found = [f"{page.relative_to(REPO)}: {m.group(0)}" for page in user_pages()
             for m in re.finditer(r"\bissue #?\d+|\bbefore this (fix|change)|\bBefore, the run\b|\btest_\w+\.py\b",
                                  page.read_text())]
    assert not found, found


def test_benchmarks_page_shows_the_published_results():
    """docs/benchmarks.md's results section is `python benchmarks/publish.py --render` of benchmarks/results/: every
    published table with its machine and date, the unmeasured benchmarks named, and no claim about GPT-NeoX."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from publish import BENCHMARKS, rendered_page

    page = (DOCS / "benchmarks.md").read_text()
    assert page == rendered_page(), "run `python benchmarks/publish.py --render`"
    assert sorted(BENCHMARKS) == sorted(p.stem for p in (REPO / "benchmarks").glob("*.py")
                                        if p.stem not in ("bench_common", "publish"))
    assert "GPT-NeoX itself has not been measured" in page
