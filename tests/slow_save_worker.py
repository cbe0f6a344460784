r"""`python -m allatt_jax.main` whose checkpoint of one step stalls before its commit.

  python tests/slow_save_worker.py STEP MARKER --config=... --workdir=...

orbax writes a checkpoint into `<step>.orbax-checkpoint-tmp/` and renames it to
`<step>/` once complete. Here, once everything of step STEP is written, the rename
waits (after creating the file MARKER) until the test kills the process: what a
crash during that save leaves behind.
"""
import pathlib
import sys
import time

import jax
from orbax.checkpoint._src.path import atomicity

from allatt_jax import cli
from allatt_jax import main


def stall_commit_of(step: str, marker: str) -> None:
  commit = atomicity.AtomicRenameTemporaryPath.finalize

  async def stalled_commit(self):
    if self.get_final().name == step:
      pathlib.Path(marker).touch()
      time.sleep(600)
    await commit(self)

  atomicity.AtomicRenameTemporaryPath.finalize = stalled_commit


if __name__ == "__main__":
  stall_commit_of(*sys.argv[1:3])
  del sys.argv[1:3]
  jax.config.config_with_absl()
  cli.run(main.main)
