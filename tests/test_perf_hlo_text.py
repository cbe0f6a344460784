"""The HLO text reader on a module written out by hand, in XLA's printer's format: which
computation is the entry and which instruction the root, what each instruction calls,
its attributes, its arrays' bytes, its users and the scope its metadata names."""
import pytest

from allatt_jax.perf import hlo_text

_MODULE = """\
HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0})->f32[4,8]{1,0}}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(f32[] %x, f32[] %y)
}

%fused_exp (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8]{1,0} parameter(0)
  %pre = f32[4,8]{1,0} negate(f32[4,8]{1,0} %p), metadata={op_name="jit(step)/layer_0/neg"}
  ROOT %e = f32[4,8]{1,0} exponential(f32[4,8]{1,0} %pre), metadata={op_name="jit(step)/layer_1/exp"}
  %post = f32[4,8]{1,0} negate(f32[4,8]{1,0} %p)
}

%fused_neg (q: f32[4,8]) -> f32[4,8] {
  %q = f32[4,8]{1,0} parameter(0)
  %n = f32[4,8]{1,0} negate(f32[4,8]{1,0} %q), metadata={op_name="jit(step)/layer_2/neg"}
  ROOT %m = f32[4,8]{1,0} multiply(f32[4,8]{1,0} %n, f32[4,8]{1,0} %n)
}

%cond (c: (s32[], f32[4,8])) -> pred[] {
  %c = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element((s32[], f32[4,8]{1,0}) %c), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(s32[] %i, s32[] %limit), direction=LT
}

%body (b: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %b = (s32[], f32[4,8]{1,0}) parameter(0)
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(s32[] %b, f32[4,8]{1,0} %b)
}

%then (a0: f32[4,8]) -> f32[4,8] {
  ROOT %a0 = f32[4,8]{1,0} parameter(0)
}

ENTRY %main (arg: f32[4,8]) -> f32[4,8] {
  %arg = f32[4,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %sq = f32[4,8]{1,0} multiply(f32[4,8]{1,0} %arg, f32[4,8]{1,0} %arg), metadata={op_name="jit(step)/a/mul;jit(step)/b/mul"}
  %f1 = f32[4,8]{1,0} fusion(f32[4,8]{1,0} %sq), kind=kLoop, calls=%fused_exp
  %f2 = f32[4,8]{1,0} fusion(f32[4,8]{1,0} %f1), kind=kLoop, calls=%fused_neg
  %init = (s32[], /*index=1*/f32[4,8]{1,0}) tuple(s32[] %zero, /*index=1*/f32[4,8]{1,0} %f2)
  %loop = (s32[], f32[4,8]{1,0}) while((s32[], f32[4,8]{1,0}) %init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %x_loop = f32[4,8]{1,0} get-tuple-element((s32[], f32[4,8]{1,0}) %loop), index=1
  %flag = pred[] constant(true)
  %if = f32[4,8]{1,0} conditional(pred[] %flag, f32[4,8]{1,0} %x_loop, f32[4,8]{1,0} %x_loop), true_computation=%then, false_computation=%else
  %gemm = (bf16[4,8]{1,0}, s8[16]{0}) custom-call(f32[4,8]{1,0} %if, f32[4,8]{1,0} %if), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"]}}}
  %dyn = f32[<=10,8]{1,0} parameter(1)
  %low = f8e4m3fn[4,8]{1,0} convert(f32[4,8]{1,0} %if)
  %red = f32[4]{0} reduce(f32[4,8]{1,0} %if, f32[] %zero), dimensions={1}, to_apply=%add
  ROOT %out = f32[4,8]{1,0} add(f32[4,8]{1,0} %if, f32[4,8]{1,0} %if)
}

%else (a1: f32[4,8]) -> f32[4,8] {
  ROOT %a1 = f32[4,8]{1,0} parameter(0)
}
"""


@pytest.fixture(name="module", scope="module")
def _module():
  return hlo_text.parse(_MODULE)


def test_the_entry_and_each_computations_root_are_the_marked_ones(module):
  assert module.name == "jit_step"
  assert module.entry == "main"
  assert set(module.computations) == {"add", "fused_exp", "fused_neg", "cond", "body",
                                      "then", "else", "main"}
  assert module.computations["main"].root == "out"
  # The root is the instruction marked ROOT, also where another is printed after it;
  # the entry is the one marked ENTRY, also where another is printed after it.
  assert module.computations["fused_exp"].root == "e"
  assert module.computations["cond"].root == "lt"


def test_an_instruction_reads_its_shape_opcode_operands_and_attributes(module):
  red = module.computations["main"].instructions["red"]
  assert (red.shape, red.opcode, red.operands) == ("f32[4]{0}", "reduce", ("if", "zero"))
  assert red.attribute("dimensions") == "{1}"
  assert red.dims("dimensions") == (1,)
  assert red.attribute("direction") is None
  loop = module.computations["main"].instructions["loop"]
  assert loop.attribute("body") == "%body"
  assert loop.trip_count == 3


def test_what_an_instruction_calls(module):
  main = module.computations["main"].instructions
  assert main["f1"].called == ("fused_exp",)
  assert main["loop"].called == ("cond", "body")
  assert main["if"].called == ("then", "else")
  assert main["red"].called == ("add",)
  assert main["out"].called == ()
  # Branch 0 of a predicated conditional is its true computation.
  assert main["if"].branches == ("then", "else")


def test_an_arrays_bytes_come_from_its_element_type_and_dims(module):
  main = module.computations["main"].instructions
  # A tuple's arrays add up: 4*8 bf16 and 16 s8.
  assert main["gemm"].bytes == 4 * 8 * 2 + 16
  assert main["gemm"].gemm_contracting_dims == (1,)
  assert main["low"].bytes == 4 * 8                 # an f8 element is a byte
  assert main["dyn"].elements == 10 * 8             # a dynamic dim at its bound
  assert main["loop"].elements == 1                 # of its first array, s32[]
  # The printer's index comments in long lists are no part of a shape or an operand.
  assert main["init"].operands == ("zero", "f2")
  assert main["init"].bytes == 4 + 4 * 8 * 4
  assert main["red"].gemm_contracting_dims is None


def test_an_operand_used_twice_has_its_user_once(module):
  main = module.computations["main"]
  assert [i.name for i in main.users("if")] == ["gemm", "low", "red", "out"]
  assert [i.name for i in main.users("arg")] == ["sq"]


def test_a_scope_is_the_first_merged_name_and_a_fusion_without_one_takes_its_roots(module):
  main = module.computations["main"].instructions
  assert main["sq"].op_name == "jit(step)/a/mul"
  # Its root's scope, not the first one inside it; and that one where the root has none.
  assert module.op_name(main["f1"]) == "jit(step)/layer_1/exp"
  assert module.op_name(main["f2"]) == "jit(step)/layer_2/neg"
  assert module.op_name(main["zero"]) == ""


def test_text_without_an_entry_computation_is_refused():
  with pytest.raises(ValueError, match="No ENTRY computation"):
    hlo_text.parse(_MODULE.replace("ENTRY %main", "%main"))
