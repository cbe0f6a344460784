"""The README's generated blocks: markers present, rewritten in place, checked."""
import pathlib

import pytest

from allatt_jax.reports import readme_blocks
from allatt_jax.config.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = {"demo", "score", "sample"}


def test_readme_has_every_generated_block():
  readme = (ROOT / "README.md").read_text()
  blocks = {name: f"new {name}\n" for name in NAMES}
  rewritten = readme_blocks.rewrite_blocks(readme, blocks)
  for name in NAMES:
    assert f"<!-- generated:{name} -->\nnew {name}\n<!-- end:{name} -->" in rewritten
  # Rewriting is idempotent and leaves everything outside the markers alone.
  assert readme_blocks.rewrite_blocks(rewritten, blocks) == rewritten
  assert readme_blocks.rewrite_blocks(
      rewritten, {name: readme[readme.index(f"<!-- generated:{name} -->\n")
                               + len(f"<!-- generated:{name} -->\n"):
                               readme.index(f"<!-- end:{name} -->")]
                  for name in NAMES}) == readme


def test_the_score_block_shows_the_scored_text():
  readme = (ROOT / "README.md").read_text()
  block = readme[readme.index("<!-- generated:score -->"):readme.index("<!-- end:score -->")]
  assert " ".join(readme_blocks.SCORED_TEXT.split()) in " ".join(block.split())


def test_markers_and_blocks_must_match():
  text = "a\n<!-- generated:demo -->\nold\n<!-- end:demo -->\nb\n"
  assert readme_blocks.rewrite_blocks(text, {"demo": "new"}) == (
      "a\n<!-- generated:demo -->\nnew\n<!-- end:demo -->\nb\n")
  with pytest.raises(ConfigError, match=r"blocks \['demo'\].*\['demo', 'score'\]"):
    readme_blocks.rewrite_blocks(text, {"demo": "x", "score": "y"})
