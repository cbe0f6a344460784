r"""`python -m allatt_jax.main` whose checkpoint saves stall before their commit once
the file STALL exists.

  python tests/stalled_save_worker.py STALL MARKER --config=... --workdir=...

orbax writes a checkpoint into `<step>.orbax-checkpoint-tmp/` and renames it to
`<step>/` once complete. Once STALL exists, the rename of the next save waits (after
creating the file MARKER) until the process ends: a test then presses Ctrl-C again
while the checkpoint of the first Ctrl-C is being saved.
"""
import pathlib
import sys
import time

import jax
from orbax.checkpoint._src.path import atomicity

from allatt_jax import cli
from allatt_jax import main


def stall_commits_after(stall: str, marker: str) -> None:
  commit = atomicity.AtomicRenameTemporaryPath.finalize

  async def stalled_commit(self):
    if pathlib.Path(stall).exists():
      pathlib.Path(marker).touch()
      time.sleep(600)
    await commit(self)

  atomicity.AtomicRenameTemporaryPath.finalize = stalled_commit


if __name__ == "__main__":
  stall_commits_after(*sys.argv[1:3])
  del sys.argv[1:3]
  jax.config.config_with_absl()
  cli.run(main.main)
