r"""`python -m allatt_jax.main` whose checkpoint saves stall before their commit.

  python tests/stalled_save_worker.py WHEN MARKER --config=... --workdir=...

orbax writes a checkpoint into `<step>.orbax-checkpoint-tmp/` and renames it to
`<step>/` once complete. Here the rename of a save waits (after creating the file
MARKER) until the process ends, for the save WHEN names:

  step:N     the save of step N: a test kills the process then, leaving what a crash
             during that save leaves behind;
  file:PATH  every save once the file PATH exists: a test presses Ctrl-C again while
             the checkpoint of its first Ctrl-C is being saved.
"""
import pathlib
import sys
import time

import jax
from orbax.checkpoint._src.path import atomicity

from allatt_jax.config import cli
from allatt_jax import main


def stall_commits(when: str, marker: str) -> None:
  kind, _, value = when.partition(":")
  if kind not in ("step", "file"):
    raise SystemExit(f"WHEN must be step:N or file:PATH, not {when!r}")
  commit = atomicity.AtomicRenameTemporaryPath.finalize

  async def stalled_commit(self):
    if (self.get_final().name == value if kind == "step" else pathlib.Path(value).exists()):
      pathlib.Path(marker).touch()
      time.sleep(600)
    await commit(self)

  atomicity.AtomicRenameTemporaryPath.finalize = stalled_commit


if __name__ == "__main__":
  stall_commits(*sys.argv[1:3])
  del sys.argv[1:3]
  jax.config.config_with_absl()
  cli.run(main.main)
