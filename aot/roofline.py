"""A roofline of a compiled step, kernel by kernel, read from its optimized HLO.

`kernels(hlo_text)` lists what the program launches: every instruction of
the entry computation and of the computations it runs as loops or branches
(while bodies and conditions, conditional branches, called computations),
except those that launch nothing (parameters, constants, tuples, bitcasts,
the while / conditional / call instructions themselves, the `-done` half of
an asynchronous pair). A fusion, a custom call (a cuBLAS GEMM, a cuDNN or
Pallas attention kernel), a collective or a lone op is one kernel; one in a
loop's body counts once per iteration (`aot.compiler.multiplicities`).

Per kernel, per run:

- FLOPs: 2 x (result elements) x (contracted size) for each dot in it
  (inside a fusion too) and from a cuBLAS GEMM's shapes and dimension
  numbers; for each convolution (how libtpu writes most dots) 2 x output
  batch x output features x input features x the window positions that
  read the input rather than its padding (`_convolution_flops`).
  Attention kernels by the FlashAttention convention (docs/benchmarks.md):
  a forward 4 B H T S D, half when causal; a fused backward 2.5 forwards. A
  backward split in two kernels recomputes QK^T and dO V^T in both: its dQ
  kernel counts 1.5 forwards (three matmuls), its dK/dV kernel 2 (four),
  3.5 in all. A cuDNN call's mask type says whether it is causal; a Pallas
  kernel's mask is compiled into its code, so `causal` (the model's) says
  it. The gated delta rule's kernel counts its chunks' matmuls
  (`gated_delta.chunk_flops`), its backward kernel the backward's
  (`gated_delta.backward_chunk_flops`), the fused head-and-loss kernels
  theirs (`fused_loss.kernel_flops`: the forward 2 N V M, 4 N V M
  differentiated, dW 4 N V M). Every other op counts 0 FLOPs.
- bytes read and written: the operands' and the results' array shapes x
  their dtype size (what a kernel moves through HBM once), except that an
  operand only sliced counts its slices and a buffer updated in place its
  update (`_bytes`).
- a GEMM's operand dtypes (`_gemm_operands`): under model.fp8 the
  projections' GEMMs read f8e4m3fn (inputs and weights) and f8e5m2 (output
  gradients); their FLOPs count at the chip's FP8 peak (`Chip.fp8_peak_flops`).
- time at peak: FLOPs / peak FLOP/s, bytes / HBM bandwidth, and the larger
  of the two, plus `launch_seconds` per kernel (`LAUNCH_SECONDS`).

`group_of` puts each kernel in the part of the model it comes from, by its
`op_name` metadata (the named scopes of the model and the train step).
`summary` adds it all up: a predicted step time (the sum over kernels of
max(FLOP time, byte time) + launch), per group and per kernel.
"""
import dataclasses
import math
import re

from aot import compiler, targets
from aot.compiler import COLLECTIVES, KERNEL_CALLS, multiplicities
from configs import gpt2_small, validation
from model import accounting
from model.kernels import fused_loss, gated_delta
from model.resolve import resolve

# Seconds a kernel costs beyond its FLOPs and bytes, a stated constant, not a
# measurement: on a GPU the launch and the gap between two kernels, about 5 us
# for a small kernel (CUDA graphs shorten it; XLA uses them for some loops);
# a TPU runs the program's ops back to back from one binary, without host
# launches, so 0.
LAUNCH_SECONDS = {"gpu": 5e-6, "tpu": 0.0}

GROUPS = ("attention", "mlp", "norms and residuals", "head and loss", "optimizer",
          "casts and copies", "collectives", "other")

_DTYPE_BYTES = {"pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
                "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY_RE = re.compile(r"\b(pred|[suf]\d+|bf16|f8e4m3fn|f8e5m2|c64|c128)\[([\d,]*)\]")
_INSTRUCTION_RE = re.compile(r"^\s*(ROOT )?%([\w.\-]+) = (.*?) ([a-z][a-z0-9\-]*)\((.*)$")
_OP_NAME_RE = re.compile(r'op_name="([^"]*)"')
# Instructions that launch nothing: bookkeeping, or a loop whose body's kernels count instead.
_NO_KERNEL = frozenset({"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
                        "while", "conditional", "call", "after-all", "partition-id",
                        "replica-id", "opt-barrier", "add-dependency", "domain"})
_COLLECTIVE_OPS = frozenset(COLLECTIVES) | {f"{kind}-start" for kind in COLLECTIVES}
# The forwards' worth of matmuls an attention kernel runs, by its name's end.
_ATTENTION_FACTORS = (("forward", 1.0), ("fwd", 1.0), ("dq", 1.5), ("dkdv", 2.0),
                      ("backward", 2.5), ("bwd", 2.5))


@dataclasses.dataclass
class Kernel:
  """One kernel of the program: an instruction that launches work."""
  name: str  # the instruction's name
  kind: str  # the opcode; a fusion's kind (kLoop, ...); a custom call's target
  op_name: str  # its metadata's op_name ("" where it has none)
  group: str  # one of GROUPS
  runs: int  # launches per step (a loop body's kernel: the trip count)
  flops: float  # per launch
  bytes_read: int  # per launch
  bytes_written: int  # per launch
  gemm_operands: str = ""  # a GEMM's (`_gemm_operands`) operand dtypes, "bf16,bf16"; else ""


def _arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
  """The (dtype, dims) of each array of an HLO shape ('f32[2,3]{1,0}' or a tuple)."""
  return [(dtype, tuple(int(d) for d in dims.split(",") if d))
          for dtype, dims in _ARRAY_RE.findall(shape)]


def _nbytes(arrays) -> int:
  return int(sum(math.prod(dims) * _DTYPE_BYTES.get(dtype, 4) for dtype, dims in arrays))


def _split_arguments(rest: str) -> tuple[str, str]:
  """(the text inside an opcode's parentheses, the attributes after them) of
  the text after its '('."""
  depth = 1
  for i, char in enumerate(rest):
    depth += {"(": 1, ")": -1}.get(char, 0)
    if depth == 0:
      return rest[:i], rest[i + 1:]
  return rest, ""


@dataclasses.dataclass
class _Instruction:
  """One HLO instruction: `%name = shape opcode(arguments), attributes`."""
  name: str
  shape: str
  opcode: str
  arguments: str  # as written: operand names, or a parameter's number
  attributes: str
  root: bool

  @property
  def operands(self) -> list[str]:
    return re.findall(r"%([\w.\-]+)", self.arguments)


def _parse(hlo_text: str) -> tuple[dict[str, list[_Instruction]], str | None]:
  """({computation: its instructions}, the entry computation's name), the
  computations as `aot.compiler.split_computations` splits them."""
  lines, entry = compiler.split_computations(hlo_text)
  parsed = {}
  for name, body in lines.items():
    parsed[name] = []
    for match in filter(None, map(_INSTRUCTION_RE.match, body)):
      root, instruction, shape, opcode, rest = match.groups()
      arguments, attributes = _split_arguments(rest)
      parsed[name].append(_Instruction(instruction, shape, opcode, arguments, attributes,
                                       bool(root)))
  return parsed, entry


def _called(instruction: _Instruction, roles: tuple[str, ...]) -> list[str]:
  """The computations `instruction` names in its attributes `roles` (body=, calls=...)."""
  out = []
  for role, names in re.findall(r"\b(\w+)=(\{[^}]*\}|%[\w.\-]+)", instruction.attributes):
    if role in roles:
      out += re.findall(r"%([\w.\-]+)", names)
  return out


def _launching_computations(computations, entry) -> list[str]:
  """The entry and the computations it runs as its own sequences of kernels:
  while bodies and conditions, conditional branches, called computations."""
  found, todo = [], [entry] if entry else []
  while todo:
    name = todo.pop()
    if name in found or name not in computations:
      continue
    found.append(name)
    for instruction in computations[name]:
      if instruction.opcode == "while":
        todo += _called(instruction, ("body", "condition"))
      elif instruction.opcode == "conditional":
        todo += _called(instruction, ("branch_computations", "true_computation",
                                      "false_computation"))
      elif instruction.opcode == "call":
        todo += _called(instruction, ("to_apply",))
  return found


def _dot_flops(instruction: _Instruction, shapes: dict[str, str], lhs_contracting: list[int]):
  """2 x result elements x the product of the lhs's contracted dimensions."""
  result = _arrays(instruction.shape)
  lhs = _arrays(shapes.get(instruction.operands[0], "")) if instruction.operands else []
  if not result or not lhs:
    return 0.0
  contracted = math.prod(lhs[0][1][d] for d in lhs_contracting if d < len(lhs[0][1]))
  return 2.0 * math.prod(result[0][1]) * contracted


def _window_pairs(out_size: int, in_size: int, window: int, stride: int, pad_low: int,
                  dilation: int) -> int:
  """(output position, window position) pairs of one spatial dimension of a
  convolution that land on the input rather than its padding."""
  pairs = 0
  for w in range(window):
    offset = w * dilation - pad_low  # input index of output 0 at this window position
    first = max(0, -(offset // stride))  # the first output whose input index is >= 0
    last = min(out_size - 1, (in_size - 1 - offset) // stride)
    pairs += max(0, last - first + 1)
  return pairs


def _convolution_flops(instruction: _Instruction, shapes: dict[str, str]) -> float:
  """2 x output batch x output features x input features per group x, per
  spatial dimension, the (output, window) position pairs that read the input
  rather than its padding. The TPU compiler writes dots as such
  convolutions, with padded windows (`window={size=1x4 pad=0_0x3_3}`)."""
  labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", instruction.attributes)
  result = _arrays(instruction.shape)
  operands = [_arrays(shapes.get(name, "")) for name in instruction.operands[:2]]
  if not labels or not result or len(operands) < 2 or not all(operands):
    return 0.0
  lhs_labels, rhs_labels, out_labels = labels.groups()
  lhs, rhs, out = operands[0][0][1], operands[1][0][1], result[0][1]
  if not len(lhs) == len(rhs) == len(out) == len(lhs_labels):
    return 0.0
  spatial = sorted(c for c in out_labels if c.isdigit())

  def window_field(name, default):
    match = re.search(name + r"=([\d_x]+)", instruction.attributes)
    values = match.group(1).split("x") if match else []
    return values if len(values) == len(spatial) else [default] * len(spatial)

  sizes = [int(v) for v in window_field("size", "1")]
  strides = [int(v) for v in window_field("stride", "1")]
  pads = [int(v.split("_")[0]) for v in window_field("pad", "0_0")]
  dilations = [int(v) for v in window_field("rhs_dilate", "1")]
  pairs = math.prod(
      _window_pairs(out[out_labels.index(d)], lhs[lhs_labels.index(d)], size, stride, pad,
                    dilation)
      for d, size, stride, pad, dilation in zip(spatial, sizes, strides, pads, dilations))
  return (2.0 * out[out_labels.index("b")] * out[out_labels.index("f")]
          * rhs[rhs_labels.index("i")] * pairs)


def _kernel_name(op_name: str) -> str:
  """A Pallas kernel's name: its op name's part before the primitive's."""
  parts = op_name.split("/")
  return parts[-2] if len(parts) >= 2 else ""


def _attention_flops(instruction: _Instruction, shapes: dict[str, str], factor: float,
                     causal: bool, heads_first: bool) -> float:
  """`factor` forwards of 4 B H T S D (half when causal), from the first two
  4-D operands (queries, keys): [B, T, H, D] and [B, S, K, D], or with
  `heads_first` [B, H, T, D] and [B, K, S, D]."""
  four_d = [a for name in instruction.operands for a in _arrays(shapes.get(name, ""))
            if len(a[1]) == 4]
  if len(four_d) < 2:
    return 0.0
  q, k = four_d[0][1], four_d[1][1]
  s = k[2] if heads_first else k[1]
  return factor * 4.0 * math.prod(q) * s / (2 if causal else 1)


def _delta_rule_flops(instruction: _Instruction, shapes: dict[str, str],
                      backward: bool) -> float:
  """The gated delta rule's kernels (`model/kernels/gated_delta.py`):
  `chunk_flops` (the forward) or `backward_chunk_flops` (the `backward`)
  per (row, value head, chunk), from their first and fourth 5-D operands,
  q [B, H, N, C, d_k] and v [B, H, N, C, d_v]."""
  five_d = [a for name in instruction.operands for a in _arrays(shapes.get(name, ""))
            if len(a[1]) == 5]
  if len(five_d) < 4:
    return 0.0
  (B, H, N, C, d_k), d_v = five_d[0][1], five_d[3][1][-1]
  per_chunk = gated_delta.backward_chunk_flops if backward else gated_delta.chunk_flops
  return float(B * H * N * per_chunk(C, d_k, d_v))


def _fused_loss_flops(instruction: _Instruction, shapes: dict[str, str], kernel: str) -> float:
  """The fused head-and-loss kernels (`model/kernels/fused_loss.py`):
  `fused_loss.kernel_flops` from their first two operands, h [N, M] and W
  [V, M]; a forward with four results computes P W as well."""
  two_d = [a for name in instruction.operands for a in _arrays(shapes.get(name, ""))
           if len(a[1]) == 2]
  if len(two_d) < 2:
    return 0.0
  (N, M), V = two_d[0][1], two_d[1][1][0]
  return fused_loss.kernel_flops(kernel, N, V, M, with_pw=len(_arrays(instruction.shape)) == 4)


def _custom_call_flops(instruction: _Instruction, shapes: dict[str, str], op_name: str,
                       causal: bool, split_backward: bool) -> float:
  """A custom call's FLOPs: a cuBLAS GEMM's dot, a cuDNN or Pallas attention
  kernel's formula (`_attention_flops`), else 0."""
  target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
  target = target.group(1) if target else ""
  if "cublas" in target:
    contracting = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attributes)
    dims = [int(d) for d in re.findall(r"\d+", contracting.group(1))] if contracting else []
    return _dot_flops(instruction, shapes, dims)
  if target.startswith("__cudnn$fmha"):
    mask = re.search(r'"mask_type":"(\w+)"', instruction.attributes)
    return _attention_flops(instruction, shapes, 2.5 if "Backward" in target else 1.0,
                            bool(mask) and "CAUSAL" in mask.group(1), heads_first=False)
  kernel = _kernel_name(op_name)
  if target in KERNEL_CALLS and "gated_delta_rule" in kernel:
    return _delta_rule_flops(instruction, shapes, backward="backward" in kernel)
  if target in KERNEL_CALLS and "fused_loss" in kernel:
    return _fused_loss_flops(instruction, shapes, kernel)
  if target in KERNEL_CALLS and "attention" in kernel:
    for suffix, factor in _ATTENTION_FACTORS:
      if kernel.endswith(suffix):
        factor = 2.5 if suffix == "dkdv" and not split_backward else factor
        return _attention_flops(instruction, shapes, factor, causal,
                                heads_first=KERNEL_CALLS[target] == "mosaic_tpu")
  return 0.0


_FP8_DTYPES = ("f8e4m3fn", "f8e5m2")


def _gemm_operands(instruction: _Instruction, shapes: dict[str, str],
                   computations: dict[str, list[_Instruction]]) -> str:
  """For a GEMM kernel (a dot, a cuBLAS GEMM, a fusion with a dot inside),
  the dtypes of the arrays it reads, scalars (a scale) left out, in operand
  order ("f8e5m2,f8e4m3fn": an FP8 product of a gradient and a weight); ""
  for any other kernel."""
  def has_dot(i):
    if i.opcode == "dot" or (i.opcode == "custom-call" and "cublas" in _kind(i)):
      return True
    return any(has_dot(j) for callee in _called(i, ("calls",))
               for j in computations.get(callee, ()))

  if not has_dot(instruction):
    return ""
  arrays = [a for name in instruction.operands for a in _arrays(shapes.get(name, ""))[:1]]
  return ",".join(dtype for dtype, dims in arrays if dims)


def reads_fp8(gemm_operands: str) -> bool:
  """Whether a GEMM of these operand dtypes (`_gemm_operands`) reads FP8."""
  return any(d in _FP8_DTYPES for d in gemm_operands.split(","))


def _kind(instruction: _Instruction) -> str:
  """A fusion's kind (kLoop, kInput, kOutput, kCustom: with its emitter, as
  kCustom:__triton_nested_gemm_fusion), a custom call's target, else the opcode."""
  if instruction.opcode == "fusion":
    kind = re.search(r"kind=(\w+)", instruction.attributes)
    emitter = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', instruction.attributes)
    return (kind.group(1) if kind else "fusion") + (f":{emitter.group(1)}" if emitter else "")
  if instruction.opcode == "custom-call":
    target = re.search(r'custom_call_target="([^"]*)"', instruction.attributes)
    return target.group(1) if target else "custom-call"
  return instruction.opcode


# Primitives that cast or move data: casts, copies, transposes, and the slices,
# updates and concatenations that stack a scan's layers or split a batch.
_CAST_OPS = frozenset({"convert_element_type", "copy", "copy_p", "transpose", "reshape",
                       "squeeze", "slice", "dynamic_slice", "dynamic_update_slice",
                       "concatenate", "pad"})


def group_of(op_name: str, opcode: str) -> str:
  """The part of the model a kernel comes from (one of GROUPS), by its op
  name's named scopes (the innermost primitive last): collectives by their
  opcode; then `optimizer`, `attention`, `mlp`, the LM head and loss
  (`logits`, `loss`, and the embedding table's lookup `_take`, whose
  gradient is the head's too), `norm`; then, outside those scopes, casts,
  copies, transposes and moves of data (`_CAST_OPS`: a scan's stacking of
  its layers' activations), and the residual stream's adds (`add`,
  `add_any`); everything else is "other"."""
  if opcode in _COLLECTIVE_OPS:
    return "collectives"
  words = set(re.findall(r"[A-Za-z_]\w*", op_name))
  primitive = op_name.rsplit("/", 1)[-1]
  if "optimizer" in words:
    return "optimizer"
  if "attention" in words:
    return "attention"
  if "mlp" in words:
    return "mlp"
  if words & {"logits", "loss", "_take"}:
    return "head and loss"
  if "norm" in words:
    return "norms and residuals"
  if opcode in ("copy", "copy-start", "transpose") or primitive in _CAST_OPS:
    return "casts and copies"
  if primitive in ("add", "add_any"):
    return "norms and residuals"
  return "other"


def kernels(hlo_text: str, *, causal: bool = True) -> list[Kernel]:
  """The kernels a compiled program launches (see the module's docstring):
  the entry computation's in program order, then each loop body's.
  `causal`: whether the Pallas attention kernels mask causally (the
  model's attention; their mask is in their code)."""
  computations, entry = _parse(hlo_text)
  runs = multiplicities(hlo_text)
  shapes = {name: {i.name: i.shape for i in instructions}
            for name, instructions in computations.items()}
  split_backward = re.search(r'op_name="[^"]*attention[^"/]*_dq/', hlo_text) is not None
  flops_of: dict[str, float] = {}

  def instruction_flops(instruction, computation, op_name):
    if instruction.opcode == "dot":
      contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", instruction.attributes)
      dims = [int(d) for d in contracting.group(1).split(",") if d] if contracting else []
      return _dot_flops(instruction, shapes[computation], dims)
    if instruction.opcode == "convolution":
      return _convolution_flops(instruction, shapes[computation])
    if instruction.opcode == "custom-call":
      return _custom_call_flops(instruction, shapes[computation], op_name, causal,
                                split_backward)
    return sum(computation_flops(callee) for callee in _called(instruction, ("calls",)))

  def computation_flops(name):
    if name not in flops_of:
      flops_of[name] = 0.0  # a cycle (none in valid HLO) counts nothing
      flops_of[name] = sum(instruction_flops(i, name, _op_name(i))
                           for i in computations.get(name, ()))
    return flops_of[name]

  out = []
  for computation in _launching_computations(computations, entry):
    for instruction in computations[computation]:
      if instruction.opcode in _NO_KERNEL or instruction.opcode.endswith("-done"):
        continue
      op_name = _op_name(instruction)
      read, written = _bytes(instruction, shapes[computation], computations)
      out.append(Kernel(instruction.name, _kind(instruction), op_name,
                        group_of(op_name, instruction.opcode), runs.get(computation, 1),
                        instruction_flops(instruction, computation, op_name), read, written,
                        _gemm_operands(instruction, shapes[computation], computations)))
  return out


_SLICES = frozenset({"slice", "dynamic-slice"})


def _bytes(instruction: _Instruction, shapes: dict[str, str],
           computations: dict[str, list[_Instruction]]) -> tuple[int, int]:
  """(bytes read, bytes written) by one kernel: its operands and results,
  except that an operand only sliced (slice, dynamic-slice) counts the
  slices, and a buffer updated in place (dynamic-update-slice, a scan's
  stacking of its layers' outputs) counts neither read nor written: its
  update is. Inside a fusion, a parameter stands for the fusion's operand.
  An asynchronous start's result tuple, which repeats its operands, counts
  its results only."""
  called = _called(instruction, ("calls",)) if instruction.opcode == "fusion" else []
  body = computations.get(called[0], []) if called else [instruction]
  names = {i.name: i for i in body}
  if called:
    parameters = {i.arguments.strip(): i.name for i in body if i.opcode == "parameter"}
    local = [parameters.get(str(n), "") for n in range(len(instruction.operands))]
    outer = dict(zip(local, instruction.operands))
  else:
    local, outer = instruction.operands, {name: name for name in instruction.operands}
  local_shapes = {i.name: i.shape for i in body} if called else shapes

  def shape(name):
    return local_shapes.get(name) or shapes.get(outer.get(name, name), "")

  root = next((i for i in body if i.root), body[-1]) if called else instruction
  outputs = ([names[o] if o in names else None for o in root.operands]
             if root.opcode == "tuple" else [root])
  updated = {o.operands[0] for o in outputs
             if o is not None and o.opcode == "dynamic-update-slice" and o.operands}
  read = 0
  for name in local:
    users = [i for i in body if name in i.operands]
    if name in updated:
      continue
    if users and all(u.opcode in _SLICES and u.operands[0] == name for u in users):
      read += sum(_nbytes(_arrays(u.shape)) for u in users)
    else:
      read += _nbytes(_arrays(shape(name)))
  if root.opcode == "tuple" or root.opcode == "dynamic-update-slice":
    written = sum(_nbytes(_arrays(shape(o.operands[1]))) if o.opcode == "dynamic-update-slice"
                  else _nbytes(_arrays(o.shape)) for o in outputs if o is not None)
    if not called and root.opcode == "tuple":
      written = _nbytes(_arrays(instruction.shape))
  else:
    results = _arrays(instruction.shape)
    operands = [a for name in instruction.operands for a in _arrays(shapes.get(name, ""))]
    if instruction.opcode.endswith("-start") and results[:len(operands)] == operands:
      results = results[len(operands):]
    written = _nbytes(results)
  return read, written


def _op_name(instruction: _Instruction) -> str:
  match = _OP_NAME_RE.search(instruction.attributes)
  return match.group(1) if match else ""


def summary(found: list[Kernel], *, peak_flops: float, hbm_bandwidth: float,
            launch_seconds: float, fp8_peak_flops: float | None = None) -> dict:
  """Per step: the kernels' count, FLOPs, bytes, and the predicted time (the
  sum over launches of max(FLOPs / peak, bytes / bandwidth) + launch; a GEMM
  that reads FP8 at `fp8_peak_flops`, default `peak_flops`), in
  all, per group (GROUPS order) and per kernel (longest first); also the
  FLOPs and bytes with each loop body counted once, as a compiler's cost
  analysis counts them; the GEMMs in all, and those that read FP8 operands
  (model.fp8) in all and by their operands' dtypes."""
  rows = []
  for k in found:
    peak = (fp8_peak_flops or peak_flops) if reads_fp8(k.gemm_operands) else peak_flops
    flop_s, byte_s = k.flops / peak, (k.bytes_read + k.bytes_written) / hbm_bandwidth
    rows.append(dict(dataclasses.asdict(k), flop_seconds=flop_s, byte_seconds=byte_s,
                     bound="compute" if flop_s >= byte_s else "memory",
                     step_seconds=k.runs * (max(flop_s, byte_s) + launch_seconds)))
  rows.sort(key=lambda r: -r["step_seconds"])

  def total(subset):
    return {"kernels": sum(r["runs"] for r in subset),
            "flops": sum(r["runs"] * r["flops"] for r in subset),
            "bytes": sum(r["runs"] * (r["bytes_read"] + r["bytes_written"]) for r in subset),
            "flop_seconds": sum(r["runs"] * r["flop_seconds"] for r in subset),
            "byte_seconds": sum(r["runs"] * r["byte_seconds"] for r in subset),
            "launch_seconds": sum(r["runs"] for r in subset) * launch_seconds,
            "step_seconds": sum(r["step_seconds"] for r in subset)}

  groups = {g: total([r for r in rows if r["group"] == g]) for g in GROUPS}
  fp8 = [r for r in rows if reads_fp8(r["gemm_operands"])]
  return {"total": total(rows),
          "gemms": total([r for r in rows if r["gemm_operands"]]),
          "fp8_gemms": {"all": total(fp8), **{
              operands: total([r for r in fp8 if r["gemm_operands"] == operands])
              for operands in sorted({r["gemm_operands"] for r in fp8})}},
          "loop_bodies_once": {"flops": sum(k.flops for k in found),
                               "bytes": sum(k.bytes_read + k.bytes_written for k in found)},
          "groups": {g: t for g, t in groups.items() if t["kernels"]},
          "kernels": rows,
          "peak_flops": peak_flops, "fp8_peak_flops": fp8_peak_flops or peak_flops,
          "hbm_bandwidth": hbm_bandwidth,
          "launch_seconds_per_kernel": launch_seconds}


# The H200's measured step of GPT-2 small (configs/gpt2_small.py, batch 32 x 1024,
# bf16 compute, float32 parameters): bench/RESULTS.md, "GPT-2 small training",
# bench.train_throughput on 2026-12-04, median of 20 steps, attention_impl=pallas
# (Mosaic GPU, which `auto` now picks there), MFU against 989 TFLOP/s.
MEASURED = {"chip": "h200", "config": "configs/gpt2_small.py", "batch_size": 32,
            "seq_len": 1024, "remat": "none", "loss_impl": "xla", "step_seconds": 0.10624,
            "mfu": 0.267,
            "source": "bench/RESULTS.md (GPT-2 small training, H200, 2026-12-04, "
                      "attention_impl=pallas)"}


def is_measured_run(config, target) -> bool:
  """Whether `config` on `target` is the run `MEASURED` timed: GPT-2 small's
  model (scanned or not) at its batch and train.remat policy on one H200
  with the whole batch's loss in XLA (train.loss_impl xla; train.loss_chunk_size
  may differ)."""
  def model(c):
    fields = c.model.to_dict()
    return {k: v for k, v in fields.items() if k not in ("scan_layers", "scan_unroll")}

  return (target.chip_name == MEASURED["chip"] and target.num_devices == 1
          and model(config) == model(gpt2_small.get_config())
          and (config.train.batch_size, config.train.seq_len)
          == (MEASURED["batch_size"], MEASURED["seq_len"])
          and validation.remat_name(config.train.remat) == MEASURED["remat"]
          and config.train.loss_impl == MEASURED["loss_impl"])


def parse_target(text: str):
  """`aot.targets.parse_target`, with `gpu:<chip>` meaning one GPU."""
  parts = text.split(":")
  return targets.parse_target(f"{text}:1" if len(parts) == 2 and parts[0] == "gpu" else text)


def roofline_report(config, target) -> dict:
  """Compiles the train step of `config` for `target`; the roofline as a JSON-able dict.

  Raises:
    UserError: as `aot.compiler.lower_step` (a config or mesh that does not fit
      the target, a target whose compiler is not installed).
  """
  measured = is_measured_run(config, target)
  config = resolve(config)
  lowered, _, mesh = compiler.lower_step(config, target)
  compiled = lowered.compile()
  chip, devices = target.chip, mesh.devices.size
  found = kernels(compiled.as_text(), causal=config.model.family != "encoder")
  report = summary(found, peak_flops=chip.peak_flops,
                            hbm_bandwidth=chip.hbm_bandwidth,
                            launch_seconds=LAUNCH_SECONDS[chip.platform],
                            fp8_peak_flops=chip.fp8_peak_flops)
  model_flops = accounting.flops_per_step(config) / devices
  predicted = report["total"]["step_seconds"]
  cost = compiler.cost_analysis(compiled)
  report.update(
      target=target.name, devices=devices, batch_size=config.train.batch_size,
      seq_len=config.train.seq_len, loss_chunk_size=config.train.loss_chunk_size,
      loss_impl=config.train.loss_impl,
      remat=validation.remat_name(config.train.remat),
      model_flops_per_device=model_flops,
      mfu_bound=model_flops / (predicted * chip.peak_flops),
      compiler_cost_analysis=({"flops": cost.get("flops"), "bytes": cost.get("bytes accessed")}
                              if cost else None),
      measured=MEASURED if measured else None,
      chip_source=chip.source)
  return report
