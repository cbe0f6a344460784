"""The README's generated blocks: markers present, rewritten in place, checked."""
import pathlib

import pytest

from allatt_jax.reports import demo_report
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


def test_a_lambda_runs_table_is_the_one_the_readme_quotes():
  """The demo prunes with λ: its table has no budget rows, and the README's block is
  what `summary_table` prints for the figures it shows."""
  readme = (ROOT / "README.md").read_text()
  start = "<!-- generated:demo -->\n```\n"
  block = readme[readme.index(start) + len(start):
                 readme.index("```\n<!-- end:demo -->")].rstrip("\n")
  title, _, _, *rows = block.splitlines()
  cells = {row.split("|")[0].strip(): [c.strip() for c in row.split("|")[1:]]
           for row in rows}
  number = lambda text: float(text.replace(",", "").rstrip("%"))
  heads = {name: [int(h) for h in cells["heads per layer"][i].split()]
           for i, name in enumerate(("baseline", "pruned"))}
  models = {name: {"valid": number(cells["valid bpc"][i]),
                   "test": number(cells["test bpc"][i]),
                   "params_non_embedding": int(number(cells["params (non-emb.)"][i])),
                   "heads_per_layer": heads[name],
                   "persistent_per_layer": [64 * h for h in heads[name]]}
            for i, name in enumerate(("baseline", "pruned"))}
  models["pruned"].update(sparsity=1 - sum(heads["pruned"]) / sum(heads["baseline"]),
                          budget=None)
  speeds = [number(c) for c in cells["inference tokens/s"]]
  report = {"dataset": title.split(":")[0], "metric": "bpc", **models,
            "speed": {"baseline_tokens_per_s": speeds[0], "pruned_tokens_per_s": speeds[1],
                      "speedup": speeds[1] / speeds[0],
                      "macs_ratio": number(cells["MACs per token"][1])}}
  assert demo_report.summary_table(report) == block
