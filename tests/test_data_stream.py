"""Training segments, evaluation batches (single- and multi-host) and the memory-carrying
read of segments."""
import os
import pathlib
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

import helpers
from allatt_jax.data import eval_batches
from allatt_jax.data import SegmentStream
from allatt_jax.data import to_global_array
from allatt_jax.config.errors import DataError
from allatt_jax.evaluation.stream_eval import read_stream
from allatt_jax.evaluation.stream_eval import row_segments

REPO = pathlib.Path(__file__).resolve().parents[1]


def _take(stream, n):
  return [next(stream) for _ in range(n)]


def test_rows_are_contiguous_across_batches_and_targets_are_shifted():
  tokens = np.arange(1001, dtype=np.int32)  # token value = its position
  stream = SegmentStream(tokens, global_batch=4, seq_len=10)
  row_length = 1000 // 4
  previous = None
  for inputs, targets in _take(stream, 5):
    assert inputs.shape == targets.shape == (4, 10) and inputs.dtype == np.int32
    np.testing.assert_array_equal(targets, inputs + 1)
    np.testing.assert_array_equal(inputs[:, 0] % row_length == 0, previous is None)
    if previous is not None:  # each row continues where it stopped
      np.testing.assert_array_equal(inputs[:, 0], previous[:, -1] + 1)
    previous = inputs
  np.testing.assert_array_equal(previous[:, 0] // row_length, np.arange(4))


def test_row_wraps_to_its_start_and_counts_epochs():
  tokens = np.arange(41, dtype=np.int32)  # 4 rows of 10 positions
  stream = SegmentStream(tokens, global_batch=4, seq_len=4)
  seen = np.concatenate([inputs for inputs, _ in _take(stream, 5)], axis=1)
  # 20 positions per row = two epochs, the second wrapping mid-segment.
  np.testing.assert_array_equal(seen, np.tile(np.arange(10), 2) + 10 * np.arange(4)[:, None])
  assert stream.get_state()['epoch'] == 2 and stream.get_state()['position'] == 0
  _, targets = next(stream)
  np.testing.assert_array_equal(targets[:, 0], 10 * np.arange(4) + 1)


def test_restored_stream_continues_identically():
  tokens = np.random.default_rng(0).integers(0, 50, 5000).astype(np.int32)
  stream = SegmentStream(tokens, global_batch=6, seq_len=7)
  _take(stream, 123)
  state = stream.get_state()
  assert all(isinstance(v, np.int64) for v in state.values())
  expected = _take(stream, 30)
  resumed = SegmentStream(tokens, global_batch=6, seq_len=7)
  resumed.set_state(jax.tree.map(np.asarray, state))  # as a checkpoint returns it
  for (inputs, targets), (want_inputs, want_targets) in zip(_take(resumed, 30), expected):
    np.testing.assert_array_equal(inputs, want_inputs)
    np.testing.assert_array_equal(targets, want_targets)
  assert resumed.get_state() == stream.get_state()


def test_restoring_state_of_another_layout_is_refused():
  tokens = np.arange(1000, dtype=np.int32)
  state = SegmentStream(tokens, 4, 8).get_state()
  with pytest.raises(DataError, match='global batch size differ'):
    SegmentStream(tokens, 8, 8).set_state(state)


def test_a_saved_position_outside_the_rows_is_refused():
  # As from a damaged checkpoint: refused, not wrapped, and the stream left as it was.
  tokens = np.arange(1000, dtype=np.int32)
  stream = SegmentStream(tokens, 4, 8)     # rows of 999 // 4 = 249 positions
  state = stream.get_state()
  for position in (-1, 249):
    with pytest.raises(DataError, match=f'position {position} is outside the rows'):
      stream.set_state({**state, 'position': np.int64(position)})
  assert stream.get_state() == state


@pytest.mark.parametrize('process_count', [2, 4])
def test_process_slices_partition_the_global_batch(process_count):
  tokens = np.random.default_rng(1).integers(0, 99, 3000).astype(np.int32)
  whole = SegmentStream(tokens, 8, 16)
  parts = [SegmentStream(tokens, 8, 16, p, process_count) for p in range(process_count)]
  for _ in range(20):
    inputs, targets = next(whole)
    local = [next(part) for part in parts]
    assert local[0][0].shape == (8 // process_count, 16)
    np.testing.assert_array_equal(np.concatenate([l[0] for l in local]), inputs)
    np.testing.assert_array_equal(np.concatenate([l[1] for l in local]), targets)


def test_bad_layouts_are_refused():
  tokens = np.arange(100, dtype=np.int32)
  with pytest.raises(DataError, match='multiple of the number of processes'):
    SegmentStream(tokens, 6, 4, process_index=0, process_count=4)
  with pytest.raises(DataError, match='too few'):
    SegmentStream(tokens, 10, 16)
  with pytest.raises(DataError, match='process_index'):
    eval_batches(tokens, 4, 4, process_index=2, process_count=2)


@pytest.mark.parametrize('num_tokens,batch,seq_len', [
    (101, 4, 5),   # 100 targets: rows of 25, last segment partial
    (98, 4, 8),    # 97 targets: the last row is shorter
    (7, 4, 3),     # 6 targets over 4 rows of 2: the last row is empty
    (2, 3, 4),     # a single target
])
def test_eval_scores_every_target_exactly_once(num_tokens, batch, seq_len):
  tokens = np.arange(num_tokens, dtype=np.int32) + 1  # 0 stays free for padding
  scored = []
  for inputs, targets, weights in eval_batches(tokens, batch, seq_len):
    assert inputs.shape == targets.shape == weights.shape == (batch, seq_len)
    assert weights.dtype == np.float32 and set(np.unique(weights)) <= {0.0, 1.0}
    np.testing.assert_array_equal(targets[weights == 1], inputs[weights == 1] + 1)
    assert not inputs[weights == 0].any() and not targets[weights == 0].any()
    scored.extend(targets[weights == 1].tolist())
  assert sorted(scored) == tokens[1:].tolist()


def test_eval_rows_are_contiguous_for_the_memory():
  tokens = np.arange(1000, dtype=np.int32)
  batches = list(eval_batches(tokens, 3, 50))
  inputs = np.concatenate([b[0] for b in batches], axis=1)
  weights = np.concatenate([b[2] for b in batches], axis=1)
  for row, row_weights in zip(inputs, weights):
    kept = row[row_weights == 1]
    np.testing.assert_array_equal(kept, np.arange(kept[0], kept[0] + len(kept)))
    assert np.all(row_weights[:len(kept)] == 1)  # padding only at the end


def test_eval_process_slices_partition_the_global_batches():
  tokens = np.arange(997, dtype=np.int32)
  whole = list(eval_batches(tokens, 4, 32))
  halves = [list(eval_batches(tokens, 4, 32, p, 2)) for p in range(2)]
  assert len(halves[0]) == len(halves[1]) == len(whole)
  for global_batch, first, second in zip(whole, *halves):
    for full, a, b in zip(global_batch, first, second):
      np.testing.assert_array_equal(np.concatenate([a, b]), full)


def test_read_stream_feeds_segments_in_order_with_the_memory_carried():
  ids_BxN = np.arange(14, dtype=np.int32).reshape(2, 7)
  segments = row_segments(ids_BxN, 3)
  assert [s.shape for s in segments] == [(2, 3), (2, 3), (2, 1)]
  np.testing.assert_array_equal(np.concatenate(segments, axis=1), ids_BxN)
  assert row_segments(ids_BxN[:, :0], 3) == []

  def step(memory, segment):   # the memory: every id read so far
    return len(memory), memory + segment[0].tolist()
  outputs, memory = read_stream(step, segments, [])
  assert outputs == [0, 3, 6] and memory == list(range(7))
  assert read_stream(step, [], ["kept"]) == ([], ["kept"])


def test_to_global_array_on_one_process():
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ('data',))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
  inputs, _ = next(SegmentStream(np.arange(500, dtype=np.int32), 4, 8))
  array = to_global_array(inputs, sharding, (4, 8))
  assert array.shape == (4, 8) and array.sharding == sharding
  np.testing.assert_array_equal(np.asarray(array), inputs)


_TWO_PROCESS_WORKER = textwrap.dedent('''
    import sys
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(f'127.0.0.1:{sys.argv[1]}', num_processes=2,
                               process_id=int(sys.argv[2]))
    from allatt_jax.data import SegmentStream
    from allatt_jax.data import to_global_array
    tokens = np.arange(3001, dtype=np.int32)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ('data',))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec('data'))
    stream = SegmentStream(tokens, 6, 10, jax.process_index(), jax.process_count())
    whole = SegmentStream(tokens, 6, 10)
    for _ in range(3):
      inputs, _ = next(stream)
      array = to_global_array(inputs, sharding, (6, 10))
      gathered = multihost_utils.process_allgather(array, tiled=True)
      np.testing.assert_array_equal(gathered, next(whole)[0])
    print('ok', jax.process_index())
''')


@pytest.mark.slow
def test_two_processes_assemble_the_global_batch(tmp_path):
  script = tmp_path / 'worker.py'
  script.write_text(_TWO_PROCESS_WORKER)
  port = str(helpers.free_port())
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONPATH': str(REPO)}
  workers = [subprocess.Popen([sys.executable, str(script), port, str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for i in range(2)]
  try:
    outputs = [worker.communicate(timeout=120)[0] for worker in workers]
  finally:
    for worker in workers:
      worker.kill()
  for i, (worker, output) in enumerate(zip(workers, outputs)):
    assert worker.returncode == 0, output
    assert f'ok {i}' in output


def test_rows_exactly_one_segment_long_are_enough():
  tokens = np.arange(21, dtype=np.int32)      # 20 targets: 4 rows of 5
  stream = SegmentStream(tokens, 4, 5)
  first, second = _take(stream, 2)
  np.testing.assert_array_equal(first[0], tokens[:20].reshape(4, 5))
  np.testing.assert_array_equal(second[0], first[0])      # the next epoch
  assert int(stream.get_state()['epoch']) == 2


def test_eval_rows_split_the_targets_as_evenly_as_they_can():
  # 100 targets over 4 rows: 25 each, so 5 segments of 5, none empty.
  batches = list(eval_batches(np.arange(101, dtype=np.int32), 4, 5))
  assert len(batches) == 5
  np.testing.assert_array_equal(sum(b[2] for b in batches).sum(axis=1), [25.0] * 4)


def test_too_few_tokens_to_evaluate_are_refused():
  with pytest.raises(DataError, match='Cannot evaluate 1 tokens with segments of 4'):
    eval_batches(np.arange(1, dtype=np.int32), 4, 4)
