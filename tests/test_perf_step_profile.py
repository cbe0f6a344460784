"""The profile's attribution of kernels to scopes: scopes fold as documented; what
counts as a matmul; an event's own time; a GPU trace (written here as a device plane
would record it) is read from its XLA Ops or stream lines; a real CPU trace attributes
the thunks of a jitted function with loops."""
import functools
import types

import jax
import jax.numpy as jnp
import pytest

from allatt_jax.perf import hlo_text
from allatt_jax.perf import scopes
from allatt_jax.perf import step_profile


@pytest.mark.parametrize("op_name, folded", [
    ("jit(train_step)/transpose(jvp(TransformerLM))/TransformerLM.hidden/layer_13/"
     "attention/while/body/closed_call/convert_element_type",
     "backward TransformerLM.hidden/layer_*/attention/convert_element_type"),
    ("jit(train_step)/jvp(TransformerLM)/embedding.nll/embedding._logsumexp/"
     "nk,vk->nv/dot_general",
     "forward embedding.nll/embedding._logsumexp/nk,vk->nv/dot_general"),
    ("jit(train_step)/jit(norm)/sqrt", "step norm/sqrt"),
    ("", "step (unnamed)"),
])
def test_scopes_fold_direction_layers_and_wrappers(op_name, folded):
  assert scopes.fold(op_name) == folded


def test_model_parts_of_folded_scopes():
  assert scopes.part("backward embedding.nll/embedding._logsumexp/exp") == "output_layer"
  assert scopes.part("forward adaptive.nll/x") == "output_layer"
  assert scopes.part("forward TransformerLM.hidden/layer_*/attention/exp") == "attention"
  assert scopes.part("forward TransformerLM.hidden/layer_*/attention_norm/mul") == "rest"
  assert scopes.part("step norm/sqrt") == "rest"


_UNNAMED_DOT = """HloModule jit_f, is_scheduled=true

%fused_computation (param_0: f32[4,8], param_1: f32[8,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  %param_1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[4,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: f32[4,8], w: f32[8,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0), metadata={op_name="x"}
  %w = f32[8,8]{1,0} parameter(1), metadata={op_name="w"}
  %neg = f32[4,8]{1,0} negate(%x), metadata={op_name="jit(f)/jvp(M)/layer_2/attention/neg"}
  %fusion = f32[4,8]{1,0} fusion(%neg, %w), kind=kCustom, calls=%fused_computation
  ROOT %copy = f32[4,8]{1,0} copy(%fusion)
}
"""


def test_an_unnamed_instruction_takes_its_producers_scope_marked_with_what_it_is():
  named = scopes.of_instructions(hlo_text.parse(_UNNAMED_DOT))
  assert named["neg"] == ("forward layer_*/attention/neg", False)
  assert named["fusion"] == ("forward layer_*/attention/[dot]", True)
  assert named["copy"] == ("forward layer_*/attention/[copy]", True)
  ops = step_profile.hlo_ops(hlo_text.parse(_UNNAMED_DOT))
  assert ops["fusion"].kind == "matmul" and ops["neg"].kind == "other"


_NESTED_AND_LIBRARY_MATMULS = """HloModule jit_g, is_scheduled=true

%inner (p0: f32[4,8], p1: f32[8,8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8,8]{1,0} parameter(1)
  ROOT %dot.2 = f32[4,8]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%outer (q0: f32[4,8], q1: f32[8,8]) -> f32[4,8] {
  %q0 = f32[4,8]{1,0} parameter(0)
  %q1 = f32[8,8]{1,0} parameter(1)
  ROOT %inner_fusion = f32[4,8]{1,0} fusion(%q0, %q1), kind=kOutput, calls=%inner
}

%plain (r0: f32[4,8]) -> f32[4,8] {
  %r0 = f32[4,8]{1,0} parameter(0)
  ROOT %exp = f32[4,8]{1,0} exponential(%r0)
}

ENTRY %main (x: f32[4,8], w: f32[8,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  %w = f32[8,8]{1,0} parameter(1)
  %outer_fusion = f32[4,8]{1,0} fusion(%x, %w), kind=kCustom, calls=%outer
  %gemm = f32[4,8]{1,0} custom-call(%outer_fusion, %w), custom_call_target="__cublas$gemm"
  %sort = f32[4,8]{1,0} custom-call(%gemm), custom_call_target="TopK"
  ROOT %exp_fusion = f32[4,8]{1,0} fusion(%sort), kind=kLoop, calls=%plain
}
"""


def test_a_matmul_is_a_dot_a_library_gemm_or_a_fusion_holding_one_at_any_depth():
  ops = step_profile.hlo_ops(hlo_text.parse(_NESTED_AND_LIBRARY_MATMULS))
  assert {name: ops[name].kind for name in ("outer_fusion", "gemm", "sort", "exp_fusion")
          } == {"outer_fusion": "matmul", "gemm": "matmul", "sort": "other",
                "exp_fusion": "fusion"}


def test_an_events_own_time_leaves_out_the_events_nested_in_it():
  event = lambda start, duration: types.SimpleNamespace(start_ns=start, duration_ns=duration)
  outer, first, second, after = event(0, 10), event(2, 3), event(5, 2), event(10, 4)
  own = dict((id(e), ns) for e, ns in step_profile._self_times(  # pylint: disable=protected-access
      [after, second, outer, first]))
  # `after` starts as `outer` ends: it is not nested in it.
  assert [own[id(e)] for e in (outer, first, second, after)] == [5, 3, 2, 4]


def _model(x, w, v):
  """A jitted function whose scopes name the model's parts, with a loop."""
  with jax.named_scope("attention"):
    h = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)[0]
  with jax.named_scope("embedding.nll"):
    return jax.nn.logsumexp(h @ v, axis=-1).sum()


@functools.lru_cache(maxsize=None)
def _compiled():
  x, w, v = (jax.random.normal(jax.random.key(i), s)
             for i, s in enumerate([(256, 256), (256, 256), (256, 512)]))
  return jax.jit(_model).lower(x, w, v).compile(), (x, w, v)


def _instruction(hlo: str, predicate) -> str:
  module = hlo_text.parse(hlo)
  return next(i.name for i in module.computations[module.entry].instructions.values()
              if predicate(module, i))


def _gpu_trace(events, lines=("Stream #7(Compute)",), before=""
               ) -> "jax.profiler.ProfileData":
  """A device plane as a GPU trace records it: kernels on each of `lines` (a stream),
  named by the kernel, with the HLO instruction and module in their stats; a summary
  line too. `before`: planes the trace holds ahead of it."""
  metadata = "".join(f'event_metadata {{ key: {i} value {{ id: {i} name: "{e[0]}" }} }}\n'
                     for i, e in enumerate(events, 1))
  def stats(op, module):
    return "".join(f'stats {{ metadata_id: {k} str_value: "{v}" }} '
                   for k, v in ((10, op), (11, module)) if v)
  kernels = "".join(f"events {{ metadata_id: {i} offset_ps: {start * 10**9} "
                    f"duration_ps: {ms * 10**9} {stats(op, module)}}}\n"
                    for i, (_, op, module, start, ms) in enumerate(events, 1))
  return jax.profiler.ProfileData.from_text_proto(f"""{before} planes {{
    id: 1 name: "/device:GPU:0"
    {"".join(f'lines {{ id: {i} name: "{line}" timestamp_ns: 0 {kernels} }}'
             for i, line in enumerate(lines, 3))}
    lines {{ id: 2 name: "XLA Modules" timestamp_ns: 0
             events {{ metadata_id: 1 offset_ps: 0 duration_ps: {10**15} }} }}
    {metadata}
    stat_metadata {{ key: 10 value {{ id: 10 name: "hlo_op" }} }}
    stat_metadata {{ key: 11 value {{ id: 11 name: "hlo_module" }} }}
  }}""")


def test_a_gpu_trace_is_read_from_its_stream_kernels():
  compiled, _ = _compiled()
  hlo = compiled.as_text()
  loop = _instruction(hlo, lambda m, i: i.opcode == "while")
  logits = _instruction(hlo, lambda m, i: scopes.part(scopes.fold(m.op_name(i)))
                        == "output_layer" and i.opcode == "fusion")
  steps = 2
  profile = _gpu_trace([
      # (kernel name, hlo_op stat, hlo_module stat, start ms, duration ms)
      ("loop_tanh_fusion", loop, "jit__model", 0, 6),
      # No stats: found by its name, with '.' and '-' written as '_'.
      (logits.replace(".", "_").replace("-", "_"), "", "", 10, 4),
      ("sm90_xmma_gemm_f32f32", "", "", 20, 2),          # cuBLAS: no HLO name
      ("other_program_fusion", "fusion.1", "jit_other", 30, 50),
  ])
  report = step_profile.breakdown(profile, hlo, steps)
  assert report["attributed"] and report["plane"] == "/device:GPU:0"
  assert report["lines"] == ["Stream #7(Compute)"]
  ops = step_profile.hlo_ops(hlo_text.parse(hlo))
  assert report["inferred_scope_ms_per_step"] == pytest.approx(
      (6 * ops[loop].inferred + 4 * ops[logits].inferred) / steps)
  assert report["kernel_ms_per_step"] == pytest.approx(12 / steps)
  assert report["unattributed_ms_per_step"] == pytest.approx(2 / steps)
  parts = report["parts"]
  assert parts["attention"]["ms_per_step"] == pytest.approx(6 / steps)
  assert parts["output_layer"]["ms_per_step"] == pytest.approx(4 / steps)
  assert parts["output_layer"]["share"] == pytest.approx(4 / 12)
  # By direction: a function that is not differentiated has neither pass, only its
  # own ('step') scopes.
  assert parts["attention"]["step_ms"] == pytest.approx(6 / steps)
  assert parts["output_layer"]["step_ms"] == pytest.approx(4 / steps)
  assert not {"forward_ms", "backward_ms"} & {*parts["attention"], *parts["output_layer"]}
  assert report["kinds_ms_per_step"]["matmul"] >= 2 / steps   # the cuBLAS kernel
  top = report["top_scopes"][0]
  assert top["name"].startswith("step ")                      # the loop's own scope
  assert top["ms_per_step"] == pytest.approx(6 / steps) and top["share"] == pytest.approx(0.5)


def test_a_gpu_trace_prefers_its_xla_ops_line_and_skips_custom_planes(monkeypatch):
  """Newer traces name each kernel's HLO instruction on an 'XLA Ops' line beside the
  stream lines, which are then not counted again; a plane of a custom device (a TPU's
  or a plugin's side plane) holds no kernels of the step."""
  compiled, _ = _compiled()
  hlo = compiled.as_text()
  loop = _instruction(hlo, lambda m, i: i.opcode == "while")
  custom = """planes { id: 2 name: "/device:CUSTOM:0" lines { id: 1 name: "Stream #1" } }"""
  profile = _gpu_trace([("loop_tanh_fusion", loop, "jit__model", 0, 6)],
                       lines=("Stream #7(Compute)", "XLA Ops"),
                       before=custom)
  report = step_profile.breakdown(profile, hlo, 1)
  assert report["plane"] == "/device:GPU:0" and report["lines"] == ["XLA Ops"]
  assert report["kernel_ms_per_step"] == pytest.approx(6)
  # A profile's traced step is the trace's wall time over its steps.
  monkeypatch.setattr(step_profile, "trace", lambda run, steps: (profile, 0.6))
  profiled = step_profile.profile(None, hlo, 3)
  assert profiled["traced_step_s"] == pytest.approx(0.2) and profiled["kernel_ms_per_step"] == (
      pytest.approx(2))


def test_a_trace_that_names_no_hlo_instruction_says_so():
  compiled, _ = _compiled()
  profile = _gpu_trace([("mystery_kernel", "", "", 0, 5)])
  report = step_profile.breakdown(profile, compiled.as_text(), 1)
  assert not report["attributed"]
  assert "does not attribute time per op" in report["note"]


def test_a_cpu_trace_attributes_thunks_and_loop_bodies():
  compiled, args = _compiled()
  run = lambda n: [jax.block_until_ready(compiled(*args)) for _ in range(n)]
  run(1)
  report = step_profile.profile(run, compiled.as_text(), steps=3)
  assert report["platform"] == "cpu" and report["plane"] == "/host:CPU"
  assert report["attributed"] and report["unattributed_ms_per_step"] == 0
  parts = report["parts"]
  assert sum(p["ms_per_step"] for p in parts.values()) == pytest.approx(
      report["kernel_ms_per_step"])
  # The loop's three matmuls and tanh run inside its event, and count as attention.
  assert parts["attention"]["ms_per_step"] > 0 and parts["output_layer"]["ms_per_step"] > 0
  assert report["kinds_ms_per_step"]["matmul"] > 0
  assert "host threads" in report["note"]
  assert any("attention" in line for line in step_profile.summary(report))
