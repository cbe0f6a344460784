"""The docs' generated blocks: markers present once, rewritten in place, checked."""
import pathlib
import re

import pytest

from allatt_jax.reports import demo_report
from allatt_jax.reports import readme_blocks
from allatt_jax.config.errors import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAMES = set(readme_blocks.BLOCK_NAMES)


def block(name: str) -> str:
  """What lies between block `name`'s markers, in whichever quoting file holds it."""
  start, end = f"<!-- generated:{name} -->\n", f"<!-- end:{name} -->"
  text = next(text for text in readme_blocks.read_quoting_files(ROOT).values()
              if start in text)
  return text[text.index(start) + len(start):text.index(end)]


def test_the_docs_quote_every_generated_block_once():
  texts = readme_blocks.read_quoting_files(ROOT)
  assert [path.relative_to(ROOT).as_posix() for path in texts] == [
      "README.md", "docs/commands.md"]
  assert "<!-- generated:demo -->" in texts[ROOT / "README.md"]
  blocks = {name: f"new {name}\n" for name in NAMES}
  rewritten = "".join(readme_blocks.rewrite_blocks(text, blocks) for text in texts.values())
  for name in NAMES:
    assert rewritten.count(f"<!-- generated:{name} -->\nnew {name}\n<!-- end:{name} -->") == 1
  for text in texts.values():
    # Rewriting is idempotent and leaves everything outside the markers alone.
    once = readme_blocks.rewrite_blocks(text, blocks)
    assert readme_blocks.rewrite_blocks(once, blocks) == once
    assert readme_blocks.rewrite_blocks(once, {name: block(name) for name in NAMES}) == text


def test_the_score_block_shows_the_scored_text():
  assert " ".join(readme_blocks.SCORED_TEXT.split()) in " ".join(block("score").split())


def test_markers_and_blocks_must_match(tmp_path):
  text = "a\n<!-- generated:demo -->\nold\n<!-- end:demo -->\nb\n"
  assert readme_blocks.rewrite_blocks(text, {"demo": "new", "score": "y"}) == (
      "a\n<!-- generated:demo -->\nnew\n<!-- end:demo -->\nb\n")
  with pytest.raises(ConfigError, match=r"blocks \['demo'\] have markers.*writes \['score'\]"):
    readme_blocks.rewrite_blocks(text, {"score": "y"})

  (tmp_path / "docs").mkdir()
  with pytest.raises(ConfigError, match=r"has no README.md or docs/commands.md"):
    readme_blocks.read_quoting_files(tmp_path)
  (tmp_path / "README.md").write_text(text + text.replace("demo", "other"))
  (tmp_path / "docs" / "commands.md").write_text(text + text.replace("demo", "score"))
  with pytest.raises(ConfigError, match=r"found \{'demo': 2, 'other': 1, 'sample': 0\} times"):
    readme_blocks.read_quoting_files(tmp_path)
  (tmp_path / "README.md").write_text(text + text.replace("demo", "sample"))
  (tmp_path / "docs" / "commands.md").write_text(text.replace("demo", "score"))
  assert list(readme_blocks.read_quoting_files(tmp_path).values()) == [
      text + text.replace("demo", "sample"), text.replace("demo", "score")]


def test_a_lambda_runs_table_is_the_one_the_readme_quotes():
  """The demo prunes with λ: its table has no budget rows, and the README's block is
  what `summary_table` prints for the figures it shows."""
  table = block("demo").removeprefix("```\n").removesuffix("```\n").rstrip("\n")
  title, _, _, *rows = table.splitlines()
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
  speed = {"baseline_tokens_per_s": speeds[0], "pruned_tokens_per_s": speeds[1],
           "speedup": speeds[1] / speeds[0], "macs_ratio": number(cells["MACs per token"][1])}
  # The speed-up measured in rounds (speed.py), with its spread.
  rounds = re.search(r"speed-up ([\d.]+)x \(middle half of (\d+) rounds: ([\d.]+)-([\d.]+);"
                     r" CPU time: ([\d.]+)x\)(, timed on a busy machine: other processes "
                     r"used ([\d.]+) of its (\d+) cores)?$", title)
  assert rounds, title
  speed.update(speedup=float(rounds[1]), rounds=int(rounds[2]),
               speedup_quartiles=[float(rounds[3]), float(rounds[4])],
               cpu_speedup=float(rounds[5]),
               machine={"busy": bool(rounds[6]), "other_cores": float(rounds[7] or 0),
                        "cores": int(rounds[8] or 0)},
               **{f"{name}_cpu_us_per_token": number(cells["CPU µs per token"][i])
                  for i, name in enumerate(("baseline", "pruned"))})
  report = {"dataset": title.split(":")[0], "metric": "bpc", **models, "speed": speed}
  assert demo_report.summary_table(report) == table
