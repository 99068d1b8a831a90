"""The manual's links and page lengths.

Every relative link in README.md, BENCHMARKS.md, docs/ and the study pages of
benchmarks/studies/ must name a file that exists and, where it has an anchor
(`page.md#section`), a heading of that page (GitHub's heading ids: lower case,
punctuation dropped, spaces to hyphens, `-1`, `-2` ... for repeats). Each page
of docs/, the BENCHMARKS.md summary and each study page stays within
`MAX_LINES`, so a reader can take in one page at a time. Pure text parsing:
no JAX, fast tier.
"""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
MAX_LINES = 400

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def pages():
  """The manual's markdown files, relative to the repository root."""
  found = [ROOT / "README.md", ROOT / "BENCHMARKS.md"]
  found += sorted((ROOT / "docs").rglob("*.md"))
  found += sorted((ROOT / "benchmarks" / "studies").glob("*.md"))
  return [p for p in found if p.exists()]


def prose_lines(text):
  """(line number, line) outside fenced code blocks."""
  inside = False
  for number, line in enumerate(text.splitlines(), 1):
    if FENCE.match(line):
      inside = not inside
      continue
    if not inside:
      yield number, line


def slug(heading):
  """GitHub's id for a heading's text."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
  text = INLINE_CODE.sub(lambda m: m.group(2), text)
  text = re.sub(r"<[^>]+>", "", text).strip().lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def anchors(path):
  """Every heading id of a markdown page, repeats numbered as GitHub does."""
  seen = {}
  ids = set()
  for _, line in prose_lines(path.read_text(encoding="utf-8")):
    match = HEADING.match(line)
    if not match:
      continue
    base = slug(match.group(2))
    count = seen.get(base, 0)
    seen[base] = count + 1
    ids.add(base if count == 0 else f"{base}-{count}")
  return ids


def links(path):
  """(line number, target) of every link outside code."""
  for number, line in prose_lines(path.read_text(encoding="utf-8")):
    for match in LINK.finditer(INLINE_CODE.sub("", line)):
      yield number, match.group(1)


def broken_links(path, root=ROOT):
  """One line per relative link of `path` whose file or anchor is missing."""
  problems = []
  for number, target in links(path):
    if SCHEME.match(target):
      continue
    file_part, _, anchor = target.partition("#")
    dest = (path.parent / file_part).resolve() if file_part else path
    where = f"{path.relative_to(root)}:{number}: {target}"
    if not dest.exists():
      problems.append(f"{where}: no such file")
    elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
      problems.append(f"{where}: no heading with id '{anchor}'")
  return problems


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(page):
  assert broken_links(page) == []


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_stay_short(page):
  lines = len(page.read_text(encoding="utf-8").splitlines())
  assert lines <= MAX_LINES, (
      f"{page.relative_to(ROOT)} has {lines} lines; split it by concept into pages"
      f" of at most {MAX_LINES} and list them in docs/README.md")


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path):
  (tmp_path / "a.md").write_text(
      "# Top `x` (y)\n\n## Top x y\n\n```\n[ignored](nowhere.md)\n```\n"
      "[ok](#top-x-y) [ok](#top-x-y-1) [bad](#nope) [gone](b.md)\n"
      "`[code](nowhere.md)` [web](https://example.com)\n",
      encoding="utf-8")
  problems = broken_links(tmp_path / "a.md", root=tmp_path)
  assert problems == [
      "a.md:8: #nope: no heading with id 'nope'",
      "a.md:8: b.md: no such file",
  ]
