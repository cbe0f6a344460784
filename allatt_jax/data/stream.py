"""Batches for Transformer-XL: B contiguous rows read T tokens at a time.

The token stream is cut into `global_batch` contiguous rows; batch k holds the
k-th length-T segment of every row, so the memory a model carries from one batch
to the next is the text right before the new segment. Process p of P reads rows
[p*B/P, (p+1)*B/P): its local batch is its slice of the global one.
"""
from collections.abc import Iterator

import jax
import numpy as np

from allatt_jax.config.errors import DataError


def _local_rows(global_batch: int, process_index: int, process_count: int) -> range:
  if global_batch <= 0 or process_count <= 0 or global_batch % process_count:
    raise DataError(f'The global batch ({global_batch}) must be a positive multiple '
                    f'of the number of processes ({process_count}).')
  if not 0 <= process_index < process_count:
    raise DataError(f'process_index {process_index} is not in [0, {process_count}).')
  per_process = global_batch // process_count
  return range(process_index * per_process, (process_index + 1) * per_process)


class SegmentStream:
  """Endless training batches (inputs, targets), targets = inputs shifted by one.

  Each row holds L = (N - 1) // B input positions. When a row runs out the next
  segment continues from the row's start (the next epoch), so every batch is
  full and every position is trained on once per epoch. The state is the
  position within the rows and the epoch, identical on every process.
  """

  def __init__(self, tokens: np.ndarray, global_batch: int, seq_len: int,
               process_index: int = 0, process_count: int = 1):
    rows = _local_rows(global_batch, process_index, process_count)
    self._row_length = (len(tokens) - 1) // global_batch
    if seq_len <= 0 or self._row_length < seq_len:
      raise DataError(
          f'{len(tokens):,} tokens are too few for a global batch of {global_batch} '
          f'rows of segments of {seq_len} tokens; use a smaller batch or seq_len.')
    self._tokens = tokens
    self._seq_len = seq_len
    self._row_starts = (np.arange(rows.start, rows.stop, dtype=np.int64)
                        * self._row_length)[:, None]
    self._columns = np.arange(seq_len, dtype=np.int64)
    self._position = 0
    self._epoch = 0

  def __iter__(self) -> 'SegmentStream':
    return self

  def __next__(self) -> tuple[np.ndarray, np.ndarray]:
    columns = (self._position + self._columns) % self._row_length
    index = self._row_starts + columns
    inputs = np.asarray(self._tokens[index], dtype=np.int32)
    targets = np.asarray(self._tokens[index + 1], dtype=np.int32)
    epochs, self._position = divmod(self._position + self._seq_len, self._row_length)
    self._epoch += epochs
    return inputs, targets

  def get_state(self) -> dict[str, np.ndarray]:
    return {'position': np.int64(self._position), 'epoch': np.int64(self._epoch),
            'row_length': np.int64(self._row_length)}

  def set_state(self, state) -> None:
    if int(state['row_length']) != self._row_length:
      raise DataError(
          f"The saved data position is for rows of {int(state['row_length'])} tokens, "
          f'but this run cuts its data into rows of {self._row_length}: the dataset or '
          'the global batch size differ from the checkpointed run.')
    position = int(state['position'])
    if not 0 <= position < self._row_length:
      raise DataError(f'Saved data position {position} is outside the rows '
                      f'(length {self._row_length}).')
    self._position = position
    self._epoch = int(state['epoch'])


def eval_batches(tokens: np.ndarray, global_batch: int, seq_len: int,
                 process_index: int = 0, process_count: int = 1
                 ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
  """One pass over `tokens`: (inputs, targets, weights), every target once.

  The N - 1 targets are cut into `global_batch` contiguous rows of
  ceil((N - 1) / B); the last rows may be shorter and the last segment partial.
  Padding has weight 0 (and token 0). All processes get the same number of
  batches, so collective ops stay in step.
  """
  rows = _local_rows(global_batch, process_index, process_count)
  num_targets = len(tokens) - 1
  if num_targets < 1 or seq_len <= 0:
    raise DataError(f'Cannot evaluate {len(tokens)} tokens with segments of '
                    f'{seq_len}: at least 2 tokens and seq_len >= 1 are needed.')
  row_length = -(-num_targets // global_batch)
  num_segments = -(-row_length // seq_len)
  row_starts = np.arange(rows.start, rows.stop, dtype=np.int64)[:, None] * row_length
  columns = np.arange(seq_len, dtype=np.int64)

  def batches():
    for segment in range(num_segments):
      position = segment * seq_len + columns
      index = row_starts + position
      valid = (position < row_length) & (index < num_targets)
      index = np.where(valid, index, 0)
      inputs = np.where(valid, tokens[index], 0).astype(np.int32)
      targets = np.where(valid, tokens[index + 1], 0).astype(np.int32)
      yield inputs, targets, valid.astype(np.float32)

  return batches()


def to_global_array(local: np.ndarray, sharding: jax.sharding.NamedSharding,
                    global_shape) -> jax.Array:
  """The global batch from each process's rows (batch axis sharded over processes).

  `sharding` must place process p's devices on rows [p*B/P, (p+1)*B/P), which a
  mesh built from `jax.devices()` (ordered by process) does.
  """
  return jax.make_array_from_process_local_data(sharding, local, tuple(global_shape))
