"""The README and docs/ as a reader meets them: every relative link and #anchor
resolves, no paragraph runs over 8 lines, and the README stays a front door."""
import math
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
PROSE_PAGES = [ROOT / "README.md", *DOCS]
LINKING_PAGES = [*PROSE_PAGES, ROOT / "launch" / "README.md"]
README_MAX_LINES = 200
PARAGRAPH_MAX_LINES = 8
# A paragraph's size is counted as if wrapped at this width, so that one long line
# does not pass for a short paragraph.
WRAP_WIDTH = 90

_FENCE = re.compile(r"^\s*(```|~~~)")
_LIST_ITEM = re.compile(r"^\s*([-*+]|\d+\.)\s")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_CODE_SPAN = re.compile(r"`[^`]*`")


def prose_lines(page: pathlib.Path):
  """(line number, line) of the page's text outside fenced code blocks."""
  fenced = False
  for number, line in enumerate(page.read_text().splitlines(), start=1):
    if _FENCE.match(line):
      fenced = not fenced
    elif not fenced:
      yield number, line


def paragraphs(page: pathlib.Path):
  """(first line number, lines) of each paragraph: prose lines between blank lines,
  each list item a paragraph of its own; headings, tables and HTML comments are not."""
  current, start = [], 0
  for number, line in [*prose_lines(page), (0, "")]:
    stripped = line.strip()
    ends = not stripped or stripped.startswith(("#", "|", "<!--")) or _LIST_ITEM.match(line)
    if ends and current:
      yield start, current
      current = []
    if stripped and not stripped.startswith(("#", "|", "<!--")):
      if not current:
        start = number
      current.append(line)


def slug(heading: str) -> str:
  """GitHub's anchor for a heading's text."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
  return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: pathlib.Path) -> set[str]:
  """The anchors of the page's headings; a repeated heading's get -1, -2, ..."""
  found, seen = set(), {}
  for _, line in prose_lines(page):
    if match := re.match(r"#{1,6}\s+(.*)", line):
      base = slug(match.group(1))
      found.add(base if base not in seen else f"{base}-{seen[base]}")
      seen[base] = seen.get(base, 0) + 1
  return found


def broken_links(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
  """'PAGE:LINE: TARGET (why)' for each relative link of the page that leads nowhere."""
  broken = []
  for number, line in prose_lines(page):
    for target in _LINK.findall(_CODE_SPAN.sub("", line)):
      if re.match(r"[a-z]+:", target):
        continue   # http(s), mailto: not this test's to check
      path, _, anchor = target.partition("#")
      resolved = (page.parent / path).resolve() if path else page
      where = f"{page.relative_to(root)}:{number}: {target}"
      if not resolved.exists():
        broken.append(f"{where} (no such file)")
      elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        broken.append(f"{where} (no heading with that anchor in {resolved.name})")
  return broken


def test_every_relative_link_and_anchor_resolves():
  broken = [b for page in LINKING_PAGES for b in broken_links(page)]
  assert not broken, "\n".join(broken)


def test_the_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path):
  (tmp_path / "other.md").write_text("# Other page\n\n## The `--profile` flag: why\n")
  page = tmp_path / "page.md"
  page.write_text("# Page\n\n[ok](other.md#the---profile-flag-why) [self](#page)\n"
                  "[gone](missing.md) [no anchor](other.md#nothing) `[code](missing.md)`\n"
                  "```\n[fenced](missing.md)\n```\n[web](https://example.com)\n")
  assert broken_links(page, root=tmp_path) == [
      "page.md:4: missing.md (no such file)",
      "page.md:4: other.md#nothing (no heading with that anchor in other.md)"]


def wrapped_size(lines: list[str]) -> int:
  return sum(max(1, math.ceil(len(line) / WRAP_WIDTH)) for line in lines)


def test_no_paragraph_is_over_8_lines():
  long = [f"{page.relative_to(ROOT)}:{start}: {wrapped_size(lines)} lines"
          for page in PROSE_PAGES for start, lines in paragraphs(page)
          if wrapped_size(lines) > PARAGRAPH_MAX_LINES]
  assert not long, "\n".join(long)


def test_paragraphs_split_at_blank_lines_and_list_items_and_skip_code_and_tables(tmp_path):
  page = tmp_path / "page.md"
  page.write_text("# Title\n\none\ntwo\n\n- item\n  goes on\n- next\n| a | b |\n"
                  "```\nnot\nprose\n```\nlast " + "x" * 200 + "\n")
  assert [(start, wrapped_size(lines)) for start, lines in paragraphs(page)] == [
      (3, 2), (6, 2), (8, 1), (14, 3)]


def test_readme_is_a_front_door():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_docs_index_lists_every_page_and_each_page_starts_with_its_command():
  index = ROOT / "docs" / "README.md"
  linked = {target.partition("#")[0] for _, line in prose_lines(index)
            for target in _LINK.findall(line)}
  assert {p.name for p in DOCS} - {"README.md"} <= linked
  for page in DOCS:
    title, *rest = page.read_text().splitlines()
    first = next(line for line in rest if line.strip())
    if page != index:
      assert title.startswith("# ") and _FENCE.match(first), (
          f"{page.name} starts with {first!r} after its title, not with its command")
