"""The HLO cost walk: on loop-free functions it counts what XLA's cost analysis counts;
loop bodies count by their trip counts, nested loops multiply, a conditional counts
its cheapest branch; slices, gathers, updates and scatters (alone or fused) move only
the rows they touch; a bf16 matmul moves bf16 bytes, as on an accelerator; on a real
train step it agrees with XLA once loops count once."""
import pathlib

import jax
import jax.numpy as jnp
import pytest

from allatt_jax.config import config_base
from allatt_jax.pruning import cost_model
from allatt_jax.perf import hlo_counts
from allatt_jax.perf import hlo_text
from allatt_jax.training import assembly
from allatt_jax.parallel import sharding
from allatt_jax.perf import timing

ROOT = pathlib.Path(__file__).resolve().parents[1]
B, D = 64, 128
MATMUL_FLOPS = 2 * B * D * D     # one (B, D) x (D, D) matmul


def _compiled(fn, *args):
  return jax.jit(fn).lower(*args).compile()


def _xla(compiled) -> dict:
  cost = compiled.cost_analysis()
  return cost[0] if isinstance(cost, (list, tuple)) else cost


def _arrays(*shapes):
  return [jax.random.normal(jax.random.key(i), s) for i, s in enumerate(shapes)]


@pytest.mark.parametrize("name, fn, shapes", [
    ("matmul", lambda x, w: x @ w, [(B, D), (D, 256)]),
    ("mlp", lambda x, w, v: jax.nn.gelu(x @ w) @ v, [(B, D), (D, 256), (256, 32)]),
    ("log_softmax", lambda x, w: jax.nn.log_softmax(x @ w, axis=-1), [(B, D), (D, 256)]),
    ("gradient", jax.grad(lambda w, x, v: jnp.sum(jnp.tanh(x @ w) @ v)),
     [(D, 256), (B, D), (256, 32)]),
    ("batched einsum", lambda a, b: jnp.einsum("bhtd,bhsd->bhts", a, b),
     [(2, 4, 16, 8), (2, 4, 32, 8)]),
    ("slices", lambda x: x[3:7] * 2 + x[10:14], [(B, D)]),
])
def test_loop_free_functions_count_what_xla_counts(name, fn, shapes):
  compiled = _compiled(fn, *_arrays(*shapes))
  analysis, xla = hlo_counts.analyse(compiled.as_text()), _xla(compiled)
  assert analysis.loops == 0, name
  assert analysis.cost.flops == xla["flops"]
  assert analysis.cost.transcendentals == xla.get("transcendentals", 0.0)
  # Observed equal on these; the walk's rules for bytes are XLA's (tuples aside).
  assert analysis.cost.bytes_accessed == pytest.approx(xla["bytes accessed"], rel=0.01)
  if name == "matmul":
    assert analysis.cost.matmul_flops == 2 * B * D * 256


def test_a_gather_reads_the_rows_it_gathers_not_the_table():
  table, ids = jnp.ones((1000, D)), jnp.array([1, 5, 9])
  analysis = hlo_counts.analyse(_compiled(lambda t, i: t[i] * 2, table, ids).as_text())
  rows = 3 * D * 4
  # XLA's analysis reads the whole table (512 KB) of a gather fused with its use.
  assert analysis.cost.bytes_accessed < 4 * rows + 1000


def _scan(n):
  return lambda x, w: jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None,
                                   length=n)[0]


@pytest.mark.parametrize("n", [4, 10])
def test_a_scan_counts_its_body_once_per_step(n):
  compiled = _compiled(_scan(n), *_arrays((B, D), (D, D)))
  analysis = hlo_counts.analyse(compiled.as_text())
  assert analysis.loops == 1 and not analysis.unknown_trip_counts
  assert analysis.cost.matmul_flops == n * MATMUL_FLOPS
  assert analysis.cost.transcendentals == n * B * D
  # What the walk is for: XLA counts the loop's body once.
  assert _xla(compiled)["flops"] < 1.01 * MATMUL_FLOPS


def test_nested_loops_multiply():
  def nested(x, w):
    inner = lambda c: jax.lax.scan(lambda c2, _: (c2 @ w, None), c, None, length=3)[0]
    return jax.lax.scan(lambda c, _: (inner(c), None), x, None, length=4)[0]
  analysis = hlo_counts.analyse(_compiled(nested, *_arrays((B, D), (D, D))).as_text())
  assert analysis.loops == 2
  assert analysis.cost.matmul_flops == 12 * MATMUL_FLOPS


def test_a_loop_of_unknown_length_counts_once_and_is_listed():
  def until(x, w, limit):
    return jax.lax.while_loop(lambda c: c[1] < limit, lambda c: (c[0] @ w, c[1] + 1),
                              (x, 0))[0]
  x, w = _arrays((B, D), (D, D))
  analysis = hlo_counts.analyse(_compiled(until, x, w, 5).as_text())
  assert len(analysis.unknown_trip_counts) == 1
  assert analysis.cost.matmul_flops == MATMUL_FLOPS


def test_a_conditional_counts_its_cheapest_branch_and_reports_the_costliest():
  def rare_fallback(x, w, p):
    return jax.lax.cond(p > 0, lambda x: x * 2, lambda x: jnp.exp(x) @ w, x)
  compiled = _compiled(rare_fallback, *_arrays((B, D), (D, D)), 1.0)
  analysis = hlo_counts.analyse(compiled.as_text())
  assert analysis.conditionals == 1
  assert analysis.cost.matmul_flops == 0 and analysis.cost.flops < 2 * B * D
  assert analysis.costliest.matmul_flops == MATMUL_FLOPS
  # XLA takes each count's maximum over the branches: here the costly branch's.
  assert analysis.costliest.flops == _xla(compiled)["flops"]
  proxy = hlo_counts.step_proxy(compiled, tokens=B)
  assert proxy["costliest_branches"]["matmul_flops"] == MATMUL_FLOPS / B


# A GPU compile's loop as XLA prints it: a cuBLAS matmul is a custom call, operands
# carry their shapes, and the backend configs are JSON.
_GPU_LOOP = """HloModule jit_f, entry_computation_layout={(f32[64,128]{1,0})->f32[64,128]{1,0}}

%body (arg: (s32[], f32[64,128], f32[128,128])) -> (s32[], f32[64,128], f32[128,128]) {
  %arg = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) %arg), index=0
  %x = f32[64,128]{1,0} get-tuple-element((s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) %arg), index=1
  %w = f32[128,128]{1,0} get-tuple-element((s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) %arg), index=2
  %gemm = (f32[64,128]{1,0}, s8[1024]{0}) custom-call(f32[64,128]{1,0} %x, f32[128,128]{1,0} %w), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/while/body/dot_general"}, backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"epilogue":"DEFAULT"}}
  %y = f32[64,128]{1,0} get-tuple-element((f32[64,128]{1,0}, s8[1024]{0}) %gemm), index=0
  %one = s32[] constant(1)
  %next = s32[] add(s32[] %i, s32[] %one)
  ROOT %out = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) tuple(s32[] %next, f32[64,128]{1,0} %y, f32[128,128]{1,0} %w)
}

%cond (arg.1: (s32[], f32[64,128], f32[128,128])) -> pred[] {
  %arg.1 = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element((s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) %arg.1), index=0
  %n = s32[] constant(6)
  ROOT %lt = pred[] compare(s32[] %i.1, s32[] %n), direction=LT
}

ENTRY %main (p: f32[64,128], q: f32[128,128]) -> f32[64,128] {
  %p = f32[64,128]{1,0} parameter(0)
  %q = f32[128,128]{1,0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) tuple(s32[] %zero, f32[64,128]{1,0} %p, f32[128,128]{1,0} %q)
  %loop = (s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) while((s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  ROOT %r = f32[64,128]{1,0} get-tuple-element((s32[], f32[64,128]{1,0}, f32[128,128]{1,0}) %loop), index=1
}
"""


def test_a_gpu_library_matmul_in_a_loop_counts_as_matmul_flops():
  analysis = hlo_counts.analyse(_GPU_LOOP)
  assert analysis.loops == 1 and not analysis.unmodelled
  assert analysis.cost.matmul_flops == 6 * MATMUL_FLOPS
  assert analysis.cost.flops == 6 * MATMUL_FLOPS + 6 + 7   # the adds, the compares
  # Each matmul reads x and w and writes its result and workspace; each add and
  # compare reads two int32 and writes one int32 or one pred.
  gemm = 4 * (64 * 128 + 128 * 128 + 64 * 128) + 1024
  assert analysis.cost.bytes_accessed == 6 * (gemm + 12) + 7 * 9


# Each way of moving data, at the top level and inside a fusion, with its own scope; a
# scatter, a map and a sort (whose flops are not modelled); and a conditional whose
# flop-free branch moves more bytes than the other.
_MOVES = """\
HloModule jit_moves, entry_computation_layout={(f32[100,8]{1,0}, f32[4,8]{1,0}, s32[], s32[3,1]{1,0}, f32[3,8]{1,0}, pred[])->f32[4,8]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

%less (a: f32[], b: f32[]) -> pred[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %lt = pred[] compare(f32[] %a, f32[] %b), direction=LT
}

%update_in_place (p0: f32[100,8], p1: f32[4,8], p2: s32[]) -> f32[100,8] {
  %p0 = f32[100,8]{1,0} parameter(0)
  %p1 = f32[4,8]{1,0} parameter(1)
  %p2 = s32[] parameter(2)
  ROOT %updated = f32[100,8]{1,0} dynamic-update-slice(f32[100,8]{1,0} %p0, f32[4,8]{1,0} %p1, s32[] %p2, s32[] %p2)
}

%rows_negated (q0: f32[100,8]) -> f32[2,8] {
  %q0 = f32[100,8]{1,0} parameter(0)
  %seen = f32[100,8]{1,0} bitcast(f32[100,8]{1,0} %q0)
  %rows = f32[2,8]{1,0} slice(f32[100,8]{1,0} %seen), slice={[0:2], [0:8]}
  ROOT %negated = f32[2,8]{1,0} negate(f32[2,8]{1,0} %rows)
}

%gathered (r0: f32[100,8], r1: s32[3,1]) -> f32[3,8] {
  %r0 = f32[100,8]{1,0} parameter(0)
  %r1 = s32[3,1]{1,0} parameter(1)
  ROOT %picked = f32[3,8]{1,0} gather(f32[100,8]{1,0} %r0, s32[3,1]{1,0} %r1), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}
}

%copy_table (c0: f32[100,8]) -> f32[100,8] {
  %c0 = f32[100,8]{1,0} parameter(0)
  ROOT %copied = f32[100,8]{1,0} copy(f32[100,8]{1,0} %c0), metadata={op_name="jit(moves)/cond/branch_0_fun/copy"}
}

%square_small (s0: f32[4,8]) -> f32[4,8] {
  %s0 = f32[4,8]{1,0} parameter(0)
  ROOT %squared = f32[4,8]{1,0} multiply(f32[4,8]{1,0} %s0, f32[4,8]{1,0} %s0), metadata={op_name="jit(moves)/cond/branch_1_fun/square"}
}

ENTRY %main (t: f32[100,8], u: f32[4,8], i: s32[], ids: s32[3,1], v: f32[3,8], p: pred[]) -> f32[4,8] {
  %t = f32[100,8]{1,0} parameter(0)
  %u = f32[4,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %ids = s32[3,1]{1,0} parameter(3)
  %v = f32[3,8]{1,0} parameter(4)
  %p = pred[] parameter(5)
  %sl = f32[4,8]{1,0} slice(f32[100,8]{1,0} %t), slice={[0:4], [0:8]}, metadata={op_name="jit(moves)/slice"}
  %ds = f32[4,8]{1,0} dynamic-slice(f32[100,8]{1,0} %t, s32[] %i, s32[] %i), dynamic_slice_sizes={4,8}, metadata={op_name="jit(moves)/dynamic_slice"}
  %g = f32[3,8]{1,0} gather(f32[100,8]{1,0} %t, s32[3,1]{1,0} %ids), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,8}, metadata={op_name="jit(moves)/gather"}
  %dus = f32[100,8]{1,0} dynamic-update-slice(f32[100,8]{1,0} %t, f32[4,8]{1,0} %u, s32[] %i, s32[] %i), metadata={op_name="jit(moves)/dynamic_update_slice"}
  %sc = f32[100,8]{1,0} scatter(f32[100,8]{1,0} %t, s32[3,1]{1,0} %ids, f32[3,8]{1,0} %v), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add, metadata={op_name="jit(moves)/scatter_add"}
  %fdus = f32[100,8]{1,0} fusion(f32[100,8]{1,0} %t, f32[4,8]{1,0} %u, s32[] %i), kind=kLoop, calls=%update_in_place, metadata={op_name="jit(moves)/fused_update"}
  %fsl = f32[2,8]{1,0} fusion(f32[100,8]{1,0} %t), kind=kLoop, calls=%rows_negated, metadata={op_name="jit(moves)/fused_slice"}
  %fg = f32[3,8]{1,0} fusion(f32[100,8]{1,0} %t, s32[3,1]{1,0} %ids), kind=kLoop, calls=%gathered, metadata={op_name="jit(moves)/fused_gather"}
  %mp = f32[4,8]{1,0} map(f32[4,8]{1,0} %u, f32[4,8]{1,0} %u), dimensions={0,1}, to_apply=%add, metadata={op_name="jit(moves)/map"}
  %srt = f32[4,8]{1,0} sort(f32[4,8]{1,0} %u), dimensions={1}, to_apply=%less, metadata={op_name="jit(moves)/sort"}
  ROOT %if = f32[4,8]{1,0} conditional(pred[] %p, f32[100,8]{1,0} %t, f32[4,8]{1,0} %u), true_computation=%copy_table, false_computation=%square_small
}
"""
TABLE, ROWS_4, ROWS_3 = 100 * 8 * 4, 4 * 8 * 4, 3 * 8 * 4   # f32 bytes
INDEX, IDS = 4, 3 * 4


def test_slices_gathers_updates_and_scatters_move_only_the_rows_they_touch():
  """Of the 3,200-byte table none of these reads more than its rows: a slice or
  gather reads what it outputs (and its indices); an update in place reads and
  writes its update; a scatter reads its updates and the rows they combine with and
  writes those; a fusion reads what its slicing users take (bitcasts looked through),
  its indices whole, and writes an in-place update's update."""
  by_scope = hlo_counts.analyse(_MOVES).by_scope
  moved = {scope.removeprefix("step "): cost.bytes_accessed
           for scope, cost in by_scope.items()}
  assert moved == {
      "slice": 2 * ROWS_4, "dynamic_slice": 2 * ROWS_4 + 2 * INDEX,
      "gather": 2 * ROWS_3 + IDS, "dynamic_update_slice": 2 * ROWS_4 + 2 * INDEX,
      "scatter_add": 3 * ROWS_3 + IDS, "fused_update": 2 * ROWS_4 + INDEX,
      "fused_slice": 2 * 2 * 8 * 4, "fused_gather": 2 * ROWS_3 + IDS,
      "map": 3 * ROWS_4, "sort": 2 * ROWS_4, "copy": 2 * TABLE}
  # A scatter combines once per update, a map once per element.
  assert by_scope["step scatter_add"].flops == 3 * 8
  assert by_scope["step map"].flops == 4 * 8


def test_a_conditional_is_cheapest_by_flops_first_and_a_sorts_flops_are_unmodelled():
  analysis = hlo_counts.analyse(_MOVES)
  assert analysis.unmodelled == {"sort": 1}
  # The copy moves 6,400 bytes to the square's 384, but computes nothing.
  assert analysis.by_scope["step copy"].flops == 0
  assert "step square" not in analysis.by_scope
  assert analysis.costliest.flops == analysis.cost.flops + 4 * 8
  assert (analysis.costliest.bytes_accessed
          == analysis.cost.bytes_accessed - 2 * TABLE + 3 * ROWS_4)


def _as_bf16_and_f16(x, w):
  y = jnp.dot(x, w, preferred_element_type=jnp.float32)
  return y.astype(jnp.bfloat16), y.astype(jnp.float16)


# XLA:CPU computes a bf16 matmul in float32, between conversions: the walk counts the
# bytes of the bf16 matmul (an accelerator's), and of a fusion reading its result.
_BF16_MATMULS = {
    "bf16 out": (lambda x, w: x @ w, 2 * (B * D + D * 256 + B * 256)),
    "f32 out": (lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
                2 * (B * D + D * 256) + 4 * B * 256),
    "tanh of it": (lambda x, w: jnp.tanh(x @ w), 2 * (B * D + D * 256) + 3 * 2 * B * 256),
    # Read as two narrower types, it is written as it is computed, and read so twice.
    "as bf16 and f16": (_as_bf16_and_f16,
                        2 * (B * D + D * 256) + 4 * B * 256 + 2 * (4 + 2) * B * 256),
}


@pytest.mark.parametrize("name", _BF16_MATMULS)
def test_a_bf16_matmul_moves_bf16_bytes_as_on_an_accelerator(name):
  fn, expected = _BF16_MATMULS[name]
  x, w = (a.astype(jnp.bfloat16) for a in _arrays((B, D), (D, 256)))
  compiled = jax.jit(fn).lower(x, w).compile(
      compiler_options=hlo_counts.COMPILER_OPTIONS)
  analysis = hlo_counts.analyse(compiled.as_text())
  assert analysis.cost.matmul_flops == 2 * B * D * 256
  assert analysis.cost.bytes_accessed == expected


@pytest.fixture(scope="module")
def tiny_train_step():
  """(the compiled baseline train step of configs/bench_cpu.py:tiny, its tokens)."""
  config = assembly.with_vocab_size(assembly.checked_config(
      config_base.load(ROOT / "configs" / "bench_cpu.py", "tiny")))
  setup, t = assembly.run_setup(config), config.train
  tokens = jax.ShapeDtypeStruct((t.batch_size, t.seq_len), jnp.int32,
                                sharding=sharding.batch_sharding(setup.mesh))
  with sharding.activate(setup.mesh):
    step = setup.train_step(sample_gates=False)
    return step.lower(setup.abstract_state, tokens, tokens).compile(), t.batch_size * t.seq_len


def test_a_train_step_counted_with_loops_once_is_xlas_count(tiny_train_step, monkeypatch):
  compiled, _ = tiny_train_step
  xla = _xla(compiled)
  counted = hlo_counts.analyse(compiled.as_text())
  monkeypatch.setattr(hlo_text.Instruction, "trip_count", property(lambda self: 1))
  once = hlo_counts.analyse(compiled.as_text())
  assert once.loops == counted.loops > 0 and not counted.unmodelled
  # Each loop's condition (one compare) runs twice for one trip; XLA counts it once.
  assert 0 <= once.cost.flops - xla["flops"] <= once.loops
  assert once.cost.transcendentals == xla["transcendentals"]
  assert once.cost.bytes_accessed == pytest.approx(xla["bytes accessed"], rel=0.03)
  assert counted.cost.matmul_flops > 1.1 * once.cost.matmul_flops   # the head loop


def test_the_proxy_splits_a_train_step_by_model_part(tiny_train_step):
  proxy = hlo_counts.step_proxy(*tiny_train_step)
  parts = proxy["parts"]
  assert set(parts) == {"output_layer", "attention", "rest"}
  for key in ("flops", "matmul_flops", "bytes"):
    assert sum(p[key] for p in parts.values()) == pytest.approx(proxy[key])
  assert parts["attention"]["matmul_flops"] > parts["output_layer"]["matmul_flops"] > 0
  assert proxy["flops"] == proxy["matmul_flops"] + proxy["other_flops"]
  assert proxy["xla_loops_once"]["flops"] < proxy["flops"]
  assert "costliest_branches" not in proxy and proxy["conditionals"] == 0
  top = proxy["top_scopes_by_bytes"]
  assert [s["bytes"] for s in top] == sorted((s["bytes"] for s in top), reverse=True)
  assert all(s["name"].split()[0] in ("forward", "backward", "step") for s in top)
  assert "layer_*/attention" in " ".join(s["name"] for s in top)


# Input and output layers: the benchmark's tied softmax; adaptive ones with div_val 2
# (each cluster projected to its own width, in the input at every position) or 1 (no
# projections), every tail at every position or at its capacity.
ADAPTIVE = dict(vocab_size=256, cutoffs=(24, 96), div_val=2, tail_capacity=0.0)


@pytest.mark.parametrize("heads_kept, output", [
    (1.0, {}), (0.5, {}), (1.0, ADAPTIVE), (0.5, {**ADAPTIVE, "tail_capacity": 2.0}),
    (1.0, {**ADAPTIVE, "div_val": 1})])
def test_an_evaluation_steps_matmul_flops_are_the_cost_models(heads_kept, output):
  """The cost model counts a forward pass's MACs by formula; the walk counts the
  compiled evaluation step's dots (pruned models and adaptive input and output
  layers included): they agree."""
  config = config_base.load(ROOT / "configs" / "bench_cpu.py", "tiny")
  config.model.update(output)
  config = assembly.with_vocab_size(assembly.checked_config(config))
  model = timing.Inference(config, timing.random_model(config), heads_kept, 1)
  model.seconds.append(model.run())
  proxy, e = model.figures()["proxy"], config.eval
  macs = cost_model.macs_per_token(model.cfg, e.seq_len, e.mem_len, e.batch_size)
  assert proxy["matmul_flops"] == pytest.approx(2 * macs["macs_per_token"], rel=0.005)
