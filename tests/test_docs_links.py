"""What README.md promises about itself and the docs: every relative link (and its #anchor) resolves,
every docs page is listed, every config is described, and the set-up is exactly two `make` targets."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose_lines(path: Path) -> list[str]:
    """The lines outside ``` fences: a `#SBATCH` line in a script is not a heading, a link in code no link."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for line in prose_lines(path):
        heading = re.match(r"#{1,6} (.+)", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def relative_links(path: Path) -> list[str]:
    links = [target for line in prose_lines(path) for target in LINK.findall(line)]
    return [target for target in links if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda path: str(path.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        file, _, anchor = target.partition("#")
        resolved = (page.parent / file).resolve() if file else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(REPO)}")
    assert not broken, broken


def test_readme_lists_every_docs_page() -> None:
    listed = set(relative_links(README))
    missing = [page.name for page in PAGES[1:] if f"docs/{page.name}" not in listed]
    assert not missing, f"README.md does not link {missing}"


def test_every_config_is_described_in_the_cli_docs() -> None:
    described = (REPO / "docs" / "cli.md").read_text()
    missing = [path.name for path in (REPO / "configs").glob("*.yaml") if f"`{path.name}`" not in described]
    assert not missing, f"docs/cli.md does not describe {missing}"


def test_the_set_up_is_two_make_targets() -> None:
    """The README's set-up block is `make train` and `make test`, both targets of the Makefile."""
    setup = README.read_text().split("### Set up on a fresh machine", 1)[1]
    block = re.search(r"```bash\n(.*?)```", setup, re.DOTALL).group(1)
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["make train", "make test"]
    makefile = (REPO / "Makefile").read_text()
    assert all(re.search(rf"^{command.split()[1]}:", makefile, re.MULTILINE) for command in commands)
