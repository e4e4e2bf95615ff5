"""The README and docs/ hold together: the README stays a short front door, every relative link (and its #anchor)
resolves, every command they quote names a script, config or module that exists, and docs/README.md lists every page.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# Relative links are also checked on the examples' and benchmarks' pages.
LINKED_PAGES = [*PAGES, *sorted((ROOT / "examples").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# A file the docs name where a command needs it: a script run by python or accelerate, a config, a notebook.
FILE_NAME = re.compile(r"(?<![\w/.-])((?:examples|benchmarks|scripts|accelerate_configs|\.ci)/[\w/.-]*\.(?:py|yaml|sh|ipynb))")
PYTHON_SCRIPT = re.compile(r"\b(?:python3?|accelerate launch|torchrun)\b[^`\n]*?(?<![\w/.-])([\w/.-]+\.py)\b")
PYTHON_MODULE = re.compile(r"\bpython3? -m (trl_lite[\w.]*)")


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(page: Path) -> str:
    return page.read_text(encoding="utf-8")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces as '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    """Every heading anchor of a markdown page, with GitHub's -1, -2 suffixes for repeated headings."""
    seen: dict[str, int] = {}
    anchors = set()
    in_code = False
    for line in _prose(page).splitlines():
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        match = re.match(r"#{1,6} (.+)", line)
        if in_code or match is None:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        anchors.add(slug if count == 0 else f"{slug}-{count}")
        seen[slug] = count + 1
    return anchors


def _relative_links(page: Path):
    for target in LINK.findall(_prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: - not checked offline
            continue
        yield target


def test_the_readme_is_a_short_front_door():
    lines = _prose(ROOT / "README.md").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the manual belongs in docs/"


def test_the_readme_quotes_the_two_commands_that_ci_and_make_run():
    readme = _prose(ROOT / "README.md")
    makefile = _prose(ROOT / "Makefile")
    for target in ("test", "demo"):
        assert f"make {target}" in readme
        assert re.search(rf"^{target}:", makefile, flags=re.M), f"Makefile has no {target} target"
    assert _prose(ROOT / ".ci" / "run").strip().splitlines()[-1] == "make test"


@pytest.mark.parametrize("page", LINKED_PAGES, ids=_page_id)
def test_every_relative_link_resolves(page):
    broken = []
    for target in _relative_links(page):
        path_part, _, anchor = target.partition("#")
        file = (page.parent / path_part).resolve() if path_part else page
        if not file.exists():
            broken.append(f"{target} (no file {file.relative_to(ROOT) if ROOT in file.parents else file})")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target} (no heading with anchor #{anchor} in {file.relative_to(ROOT)})")
    assert not broken, f"{_page_id(page)}: broken links: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_quoted_command_names_a_file_or_module_that_exists(page):
    text = _prose(page)
    named = set(FILE_NAME.findall(text))
    # A bare script name after python/accelerate launch (`python examples/x.py`, `accelerate launch ... x.py`).
    named |= {script for script in PYTHON_SCRIPT.findall(text) if "/" in script}
    missing = sorted(name for name in named if not (ROOT / name).is_file())
    modules = set(PYTHON_MODULE.findall(text))
    missing += sorted(
        module
        for module in modules
        if not (ROOT / Path(*module.split("."))).with_suffix(".py").is_file()
        and not (ROOT / Path(*module.split(".")) / "__main__.py").is_file()
    )
    assert not missing, f"{_page_id(page)} names commands for files that do not exist: {missing}"


def test_docs_readme_lists_every_page_once():
    index = _prose(DOCS / "README.md")
    listed = [target for target in LINK.findall(index) if not target.startswith("..")]
    pages = sorted(page.name for page in DOCS.glob("*.md") if page.name != "README.md")
    assert sorted(set(listed)) == pages, "docs/README.md must list every page of docs/, and only those"
    assert len(listed) == len(set(listed)), "docs/README.md lists a page twice"


def test_each_capability_row_is_one_line_linking_its_docs_page():
    readme = _prose(ROOT / "README.md")
    section = readme.split("## What it can do", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| ---")][1:]
    assert len(rows) >= 10
    for row in rows:
        links = LINK.findall(row)
        assert links and all(link.startswith("docs/") for link in links), row
