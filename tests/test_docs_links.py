"""Every relative link of the README and docs/ leads somewhere: the file exists, and a
link into a Markdown file's section names one of its headings (as GitHub makes anchors).

Links that leave the repository (the contract, ../shared/SPEC.md, sits beside the
checkout, not in it) cannot be checked from a clone and are left out, as are web links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_prometheus import github_anchor

ROOT = Path(__file__).parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document):
    broken = []
    for target in LINK.findall(document.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, anchor = target.partition("#")
        path = (document.parent / name).resolve() if name else document
        if not path.is_relative_to(ROOT):
            continue
        if not path.exists() or (anchor and path.suffix == ".md" and anchor not in anchors(path)):
            broken.append(target)
    assert not broken, broken
