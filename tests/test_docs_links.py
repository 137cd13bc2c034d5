"""Every relative Markdown link of the README and of docs/ reaches a file, and every #anchor a heading of its
target (issue 39: the README is a front door, the docs are pages; a moved section must leave no dead link).

Pure Python, no MkDocs: GitHub's anchors (lowercase, spaces to '-', punctuation other than '-' and '_' dropped,
a repeated heading numbered -1, -2, ...). http(s) and mailto links are not followed; an image link must name a
file that exists. Links inside code (fenced blocks, `spans`) are not links.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^\s*(```|~~~)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"(!?)\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
            elif m.group(1) == fence:
                fence = None
            continue
        if fence is None:
            yield n, line


def slug(heading: str) -> str:
    """GitHub's anchor of a heading's text."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link in a heading: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "-_ ")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        k = seen.get(s, 0)
        seen[s] = k + 1
        out.add(s if k == 0 else f"{s}-{k}")
    for m in re.finditer(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text(encoding="utf-8")):
        out.add(m.group(1))
    return out


def links(path: Path):
    """(line number, is image, target) of every Markdown link outside code."""
    for n, line in _prose_lines(path.read_text(encoding="utf-8")):
        line = _CODE_SPAN.sub("", line)
        for m in _LINK.finditer(line):
            yield n, m.group(1) == "!", m.group(3)


def broken_links(path: Path) -> list[str]:
    """What in one Markdown file points nowhere: 'file:line: target (why)'."""
    bad = []
    for n, image, target in links(path):
        if not target or _EXTERNAL.match(target):
            continue
        where = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}:{n}: {target}"
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{where} (no such file)")
            continue
        if image or not anchor:
            continue
        if dest.is_dir() or dest.suffix.lower() != ".md":
            bad.append(f"{where} (an anchor into a file that is not Markdown)")
        elif anchor not in anchors(dest):
            bad.append(f"{where} (no heading with that anchor in {dest.name})")
    return bad


def _pages():
    return [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))


@pytest.mark.parametrize("rel", [str(p.relative_to(ROOT)) for p in _pages()])
def test_every_relative_link_and_anchor_resolves(rel):
    bad = broken_links(ROOT / rel)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_checker_finds_a_broken_file_a_broken_anchor_and_skips_code_and_the_web(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A `code` heading — with punctuation!\n\n## Twice\n\n"
                                       "## Twice\n", encoding="utf-8")
    (tmp_path / "pic.png").write_bytes(b"\x89PNG")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n"
        "[fine](other.md) [fine anchor](other.md#a-code-heading--with-punctuation) [again](other.md#twice-1)\n"
        "[own heading](#page) ![picture](pic.png) [web](https://example.com/nowhere.md)\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-heading) ![no picture](nothing.png)\n"
        "[bad own anchor](#nowhere)\n"
        "`[in code](missing-in-code.md)`\n\n```\n[in a block](missing-in-block.md)\n```\n",
        encoding="utf-8")
    bad = broken_links(page)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "missing.md (no such file)",
        "other.md#no-such-heading (no heading with that anchor in other.md)",
        "nothing.png (no such file)",
        "#nowhere (no heading with that anchor in page.md)",
    ], bad
    assert slug("`unison probe` — measure the mismatch offline") == "unison-probe--measure-the-mismatch-offline"
    assert slug("Which log π is π_old (`policy.anchor`)") == "which-log-π-is-π_old-policyanchor"
    assert slug("On a GPU: `scripts/gpu_smoke.sh`") == "on-a-gpu-scriptsgpu_smokesh"


def test_every_page_under_docs_is_in_the_sites_nav():
    """`make docs` builds with --strict, where a page outside mkdocs.yml's nav is a warning that fails the build
    (it did: experiments/distillation.md and experiments/smollm2.md; issue 57)."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]

    def pages(node):
        if isinstance(node, str):
            yield node
        elif isinstance(node, list):
            for x in node:
                yield from pages(x)
        elif isinstance(node, dict):
            for x in node.values():
                yield from pages(x)

    listed = set(pages(nav))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert on_disk - listed == set(), f"pages not in mkdocs.yml's nav: {sorted(on_disk - listed)}"
    assert listed - on_disk == set(), f"nav entries with no page: {sorted(listed - on_disk)}"
