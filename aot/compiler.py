"""Ahead-of-time compilation of a run's steps for a slice it does not have (compile.py).

`compile_report(config, target)` builds the train step exactly as
`training/loop.py` does (the model with `train.remat`, AdamW, the mesh of
`config.mesh` and the sharding rules of `mesh.rules`) over the abstract
devices of the target (`aot/targets.py`), compiles it with the
target's real compiler and reads back, per device:

- memory: parameters and optimizer state (their shards, from the
  shardings), the compiler's arguments, outputs and temporaries
  (`memory_analysis()`), its peak (arguments + outputs - donated aliases +
  temporaries + code, or libtpu's own peak where that is larger; where
  libtpu reports no temporaries, the rest of its peak counts as them), beside `model.accounting.training_memory_bytes`;
- whether the peak fits the chip's HBM, as one line. A program the TPU
  compiler refuses for lack of HBM is not an error: its report holds the
  input shards and the temporaries the compiler's message names, and no
  cost analysis or collectives;
- FLOPs per step from `cost_analysis()` beside the PaLM formula
  (`model.accounting.flops_per_token`: 6N + 12 L S d_attn per token);
- the collectives of the compiled program, with their result bytes and the
  bytes a ring moves through each device for them (all-reduce 2 (n-1)/n x,
  all-gather and all-to-all (n-1)/n x, reduce-scatter (n-1) x its result,
  collective-permute 1 x; n the group size; a ragged-all-to-all's result
  is its receive buffer, sized for the worst routing, and its traffic
  (n-1)/n x the smaller of what it sends and that buffer, as under balanced
  routing). A collective inside a loop
  with a known trip count (scanned layers, gradient accumulation) counts
  once per iteration (`multiplicities`);
- the Pallas kernels the compiled program calls (`kernels`), read from its
  custom calls (`tpu_custom_call` for Mosaic TPU, `mosaic_gpu_v2` for Mosaic
  GPU, `__gpu$xla.gpu.triton` for Triton), each by the name its `pallas_call`
  gave it, with its count per step and per-device operand and result shapes: which
  attention the numbers describe, from the program rather than the config;
- a roofline bound: the step takes at least the longest of compute (FLOPs /
  peak), HBM traffic (`bytes accessed` / HBM bandwidth) and collective
  traffic / interconnect bandwidth, so MFU (PaLM FLOPs over that time at
  peak) is at most the returned bound. Overlap is assumed perfect: a bound,
  not a prediction. A compile-only GPU gives no cost analysis: its compute
  time uses the PaLM FLOPs and its HBM time is n/a (None in the JSON). The
  compiler's cost analysis counts a loop's body once, so for a program with
  loops (scanned layers) its FLOPs and bytes are not per step: they are
  reported as `*_loop_bodies_once` and the roofline uses the PaLM FLOPs and
  no HBM term.

`step="eval"` compiles the eval step instead (parameters only, no
optimizer), `step="generate"` one KV-cache decoding step of a decoder
(train.batch_size rows, a cache of train.seq_len positions).
"""
import math
import re
import time

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from configs.errors import UserError
from model import accounting
from model.resolve import resolve
from aot.targets import Target, target_devices
from training.optim import learning_rate_schedule, model_optimizer
from training.sharding import (BATCH_AXES, batch_sharding, batch_split, batch_split_fields,
                               make_mesh, state_shardings, train_state_shardings,
                               with_shardings)
from training.startup import state_split
from training.steps import (abstract_state, jit_eval_step, jit_train_step, router_losses,
                            traced_on)

COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "ragged-all-to-all",
               "collective-permute")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
                "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8}
_COLLECTIVE_RE = re.compile(r"=\s*(.*?)\s(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_ARRAY_RE = re.compile(r"\b(pred|[suf]\d+|bf16|c64)\[([\d,]*)\]")
KERNEL_CALLS = {"tpu_custom_call": "mosaic_tpu", "mosaic_gpu_v2": "mosaic_gpu",
                "mosaic_gpu": "mosaic_gpu", "__gpu$xla.gpu.triton": "triton"}
_COMPUTATION_RE = re.compile(r"^(ENTRY )?%([\w.\-]+) .*\{\s*$")
_TRIP_RE = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLED_RE = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|"
                        r"called_computations)=(\{[^}]*\}|%[\w.\-]+)")
_KERNEL_RE = re.compile(r"%([\w.-]+) = (.*?) custom-call\(.*custom_call_target=\"("
                        + "|".join(re.escape(target) for target in KERNEL_CALLS) + r")\"")


def abstract_batch(config, mesh) -> dict:
  """ShapeDtypeStructs of one global batch of the run, split over data x fsdp
  x expert (a batch that does not split: a UserError naming train.batch_size)."""
  t, m = config.train, config.model
  sharding = batch_sharding(mesh)
  split = batch_split(mesh)
  if t.batch_size % split:
    raise UserError(f"config field train.batch_size={t.batch_size}: does not split over "
                    f"{batch_split_fields(mesh)} = {split} devices; make it a multiple of "
                    f"{split}")

  def spec(length, dtype=jnp.int32):
    return jax.ShapeDtypeStruct((t.batch_size, length), dtype, sharding=sharding)

  if m.family == "encoder_decoder":
    tgt_len = t.tgt_seq_len or t.seq_len
    return {"src": spec(t.seq_len), "src_mask": spec(t.seq_len), "tgt_in": spec(tgt_len),
            "tgt_out": spec(tgt_len), "loss_mask": spec(tgt_len, jnp.float32)}
  return {"inputs": spec(t.seq_len), "targets": spec(t.seq_len),
          "segment_ids": spec(t.seq_len), "positions": spec(t.seq_len),
          "loss_mask": spec(t.seq_len, jnp.float32)}


def _shard_bytes(tree) -> int:
  """Bytes one device holds of a tree of ShapeDtypeStructs carrying shardings."""
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree.leaves(tree))


def _lower_train(config, mesh):
  tc = config.train
  graphdef, abstract = abstract_state(config, remat=tc.remat)
  shardings = train_state_shardings(abstract, mesh, config.mesh.rules)
  state = with_shardings(abstract, shardings)
  batch = abstract_batch(config, mesh)
  tx = model_optimizer(config)
  step = jit_train_step(graphdef, tx, learning_rate_schedule(tc), tc.objective,
                        tc.grad_accum_steps, state_sharding=shardings,
                        batch_sharding=batch_sharding(mesh), z_loss=tc.z_loss,
                        context_strategy=config.mesh.context_strategy,
                        router_losses=router_losses(config),
                        loss_chunk_size=tc.loss_chunk_size, loss_impl=tc.loss_impl)
  held = {"parameters": _shard_bytes(state["params"]),
          "optimizer_state": _shard_bytes(state["opt_state"]), "batch": _shard_bytes(batch)}
  return step.lower(state, batch), held


def _abstract_params(config, mesh):
  graphdef, abstract = abstract_state(config)
  params = abstract["params"]
  return graphdef, with_shardings(params, state_shardings(params, mesh, config.mesh.rules))


def _lower_eval(config, mesh):
  graphdef, params = _abstract_params(config, mesh)
  batch = abstract_batch(config, mesh)
  held = {"parameters": _shard_bytes(params), "optimizer_state": 0, "batch": _shard_bytes(batch)}
  return (jit_eval_step(graphdef, config.train.objective, mesh, config.mesh.context_strategy,
                        loss_chunk_size=config.train.loss_chunk_size,
                        loss_impl=config.train.loss_impl).lower(params, batch),
          held)


def _lower_generate(config, mesh):
  """One decoding step: one new token per row against a cache of seq_len positions."""
  if config.model.family != "decoder":
    raise UserError(f"--step=generate compiles a decoder's KV-cache step; model.family="
                    f"{config.model.family!r} is not a decoder")
  if config.mesh.context > 1:
    raise UserError(f"config field mesh.context={config.mesh.context}: splits the rows of "
                    "training and evaluation steps; compile --step=generate with mesh.context=1")
  graphdef, params = _abstract_params(config, mesh)
  B, L = config.train.batch_size, config.train.seq_len

  def cache_sharding(x):  # k, v [(layers,) B, K, L, D]: rows over data x fsdp, KV heads
    layers = (None,) * (x.ndim - 4)  # over tensor; a scanned stack's layers axis whole
    heads = "tensor" if x.shape[-3] % mesh.shape["tensor"] == 0 else None
    return NamedSharding(mesh, P(*layers, BATCH_AXES, heads, None, None))

  def make_cache():
    model = nnx.merge(graphdef, params)
    return model.init_cache(B, L, jnp.dtype(model.decoder.dtype))

  cache = jax.eval_shape(make_cache)
  cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                      sharding=cache_sharding(x)), cache)
  token = jax.ShapeDtypeStruct((B, 1), jnp.int32, sharding=batch_sharding(mesh))

  def decode(params, tokens_B1, positions_B1, cache):
    return nnx.merge(graphdef, params).decode_step(tokens_B1, positions_B1, cache)

  held = {"parameters": _shard_bytes(params), "optimizer_state": 0,
          "batch": 2 * _shard_bytes(token), "kv_cache": _shard_bytes(cache)}
  return (jax.jit(traced_on(mesh, decode), donate_argnums=(3,)).lower(params, token, token, cache),
          held)


def split_computations(hlo_text: str) -> tuple[dict[str, list[str]], str | None]:
  """({computation name: its instruction lines}, the entry's name) of an HLO module."""
  computations, entry, current = {}, None, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION_RE.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      entry = current if header.group(1) else entry
    elif current is not None:
      computations[current].append(line)
  return computations, entry


def _trip_count(line: str, computations: dict[str, list[str]]) -> int:
  """Iterations of the while loop of `line`: the compiler's known trip count,
  else N where its condition is `i < N` against one constant, as a JAX scan
  or fori_loop (from 0 by 1) compiles for TPUs; 1 where neither is there."""
  known = _TRIP_RE.search(line)
  if known:
    return int(known.group(1))
  condition = re.search(r"condition=%([\w.\-]+)", line)
  lines = computations.get(condition.group(1), []) if condition else []
  constants = [int(c) for l in lines for c in re.findall(r"s32\[\]\S* constant\((\d+)\)", l)]
  less_than = any(l.lstrip().startswith("ROOT") and "compare(" in l and "direction=LT" in l
                  for l in lines)
  return constants[0] if less_than and len(constants) == 1 else 1


def multiplicities(hlo_text: str) -> dict[str, int]:
  """How many times each computation of an HLO module runs per call of its
  entry: a while loop's body and condition run its trip count times
  (`_trip_count`) per run of the computation holding the loop; other called
  computations once per call."""
  computations, entry = split_computations(hlo_text)
  calls = {name: [] for name in computations}
  for name, lines in computations.items():
    for line in lines:
      called = _CALLED_RE.findall(line)
      trips = _trip_count(line, computations) if " while(" in line else 1
      for role, names in called:
        for callee in re.findall(r"%([\w.\-]+)", names):
          calls[name].append((callee, trips if role in ("body", "condition") else 1))
  runs = dict.fromkeys(calls, 0)

  def visit(name: str, times: int) -> None:
    runs[name] = runs.get(name, 0) + times
    for callee, factor in calls.get(name, ()):
      visit(callee, times * factor)

  if entry is not None:
    visit(entry, 1)
  return runs


def _lines_with_runs(hlo_text: str):
  """(line, how many times it runs per step) for every line of an HLO module
  (a line outside any computation: once)."""
  runs, current = multiplicities(hlo_text), None
  for line in hlo_text.splitlines():
    header = _COMPUTATION_RE.match(line)
    if header:
      current = header.group(2)
    yield line, runs.get(current, 1)


def has_loops(hlo_text: str) -> bool:
  """Whether the program holds a loop that runs more than once (scanned layers)."""
  computations, _ = split_computations(hlo_text)
  return any(_trip_count(line, computations) > 1 for lines in computations.values()
             for line in lines if " while(" in line)


_DEFINITION_RE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+)", re.M)
_RAGGED_OPERAND_RE = re.compile(r"ragged-all-to-all\(%([\w.\-]+)")


def _array_bytes(shape: str) -> list[int]:
  """The bytes of each array in an HLO shape ('f32[2,3]', or a tuple of them)."""
  return [math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dtype, 4)
          for dtype, dims in _ARRAY_RE.findall(shape)]


def collectives(hlo_text: str) -> dict[str, dict]:
  """Per collective kind: count, result bytes and ring traffic bytes per device
  per step (a collective in a loop's body once per iteration)."""
  out = {}
  shapes = None
  for line, runs in _lines_with_runs(hlo_text):
    match = _COLLECTIVE_RE.search(line)
    if not match:
      continue
    shape, kind, start = match.groups()
    # An async start's tuple holds operands and results; its result is the largest.
    size = max(_array_bytes(shape), default=0) if start and kind != "all-reduce" else sum(
        _array_bytes(shape))
    n = _group_size(line)
    traffic = {"all-reduce": 2 * (n - 1) / n, "all-gather": (n - 1) / n,
               "all-to-all": (n - 1) / n, "ragged-all-to-all": (n - 1) / n,
               "reduce-scatter": n - 1, "collective-permute": 1}[kind] * size
    if kind == "ragged-all-to-all":
      shapes = shapes or dict(_DEFINITION_RE.findall(hlo_text))
      operand = _RAGGED_OPERAND_RE.search(line).group(1)
      traffic = min(traffic, (n - 1) / n * sum(_array_bytes(shapes.get(operand, ""))))
    entry = out.setdefault(kind, {"count": 0, "bytes": 0, "traffic_bytes": 0})
    entry["count"] += runs
    entry["bytes"] += runs * size
    entry["traffic_bytes"] += runs * int(traffic)
  return out


_ASYNC_RE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = .*?\s(" + "|".join(COLLECTIVES)
                       + r")-(start|done)\((%[\w.\-]+)?")
_OPCODE_RE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = .*?\s([a-z][a-z\-]*)\(")
# Instructions that compute (a kernel, a fused loop of ops, a loop or branch of them).
_COMPUTE_OPS = frozenset({"fusion", "custom-call", "while", "conditional", "call", "dot",
                          "convolution"})


def async_overlap(hlo_text: str) -> dict[str, dict]:
  """Per collective kind compiled asynchronous (a `-start` / `-done` pair):
  how many pairs run per step, and how many of those have compute scheduled
  between start and done (`_COMPUTE_OPS`, in the scheduled program's order),
  which is where the compiler overlaps the transfer with work."""
  computations, _ = split_computations(hlo_text)
  runs = multiplicities(hlo_text)
  out = {}
  for name, lines in computations.items():
    started = {}
    for i, line in enumerate(lines):
      match = _ASYNC_RE.match(line)
      if not match:
        continue
      instruction, kind, phase, operand = match.groups()
      if phase == "start":
        started[instruction] = i
        continue
      begin = started.get((operand or "%")[1:])
      if begin is None:
        continue
      between = (_OPCODE_RE.match(l) for l in lines[begin + 1:i])
      entry = out.setdefault(kind, {"async": 0, "overlapped": 0})
      entry["async"] += runs.get(name, 1)
      if any(m and m.group(1) in _COMPUTE_OPS for m in between):
        entry["overlapped"] += runs.get(name, 1)
  return out


def _unique_shapes(text: str) -> list[str]:
  """The array shapes named in `text` ("f32[4,2,128,64]"), each once, in order."""
  return list(dict.fromkeys(f"{dtype}[{dims}]" for dtype, dims in _ARRAY_RE.findall(text)))


def kernels(hlo_text: str) -> dict[str, dict]:
  """Per Pallas kernel of a compiled program: its lowering, count, operand and
  result shapes (per device).

  A kernel is named by its `pallas_call`'s name: the op name's part before
  the primitive's (`.../flash_attention_tpu_dq/pallas_call`,
  `.../flash_attention_hopper_forward/mpmd_map`), else the instruction's
  name. Operand shapes are those the compiler's layout constraints list
  (empty where it lists none).
  """
  out = {}
  for line, runs in _lines_with_runs(hlo_text):
    match = _KERNEL_RE.search(line)
    if not match:
      continue
    instruction, shape, target = match.groups()
    op_name = re.search(r'op_name="(?:[^"]*/)?([^"/]+)/[^"/]+"', line)
    name = op_name.group(1) if op_name else re.sub(r"\.\d+$", "", instruction)
    operands = re.search(r"operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\}", line)
    entry = out.setdefault(name, {"lowering": KERNEL_CALLS[target], "count": 0,
                                  "operands": [], "results": []})
    entry["count"] += runs
    for key, text in (("operands", operands.group(1) if operands else ""), ("results", shape)):
      entry[key] += [s for s in _unique_shapes(text) if s not in entry[key]]
  return out


def _group_size(line: str) -> int:
  """Devices per replica group of an HLO collective (1 when it names none)."""
  named = re.search(r"replica_groups=mesh\[(.*?)\][^{]*\{('[^}]*)\}", line)
  if named:  # mesh['axis_0'=4,'axis_1'=1][, device_ids=...] {'axis_0'}: the listed axes
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", named.group(1)))
    return math.prod(int(sizes[axis]) for axis in re.findall(r"'(\w+)'", named.group(2)))
  iota = re.search(r"replica_groups=\[(\d+),(\d+)\]", line)
  if iota:
    return int(iota.group(2))
  listed = re.search(r"replica_groups=\{\{([\d,]*)\}", line)
  if listed and listed.group(1):
    return len(listed.group(1).split(","))
  pairs = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
  return 2 if pairs else 1


def cost_analysis(compiled) -> dict:
  """The compiler's cost analysis; empty where it gives none (a compile-only GPU)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  return cost or {}


def _accounting(config, mesh, step: str, platform: str) -> dict:
  """model.accounting's estimate per device: parameters and optimizer state split
  over fsdp x tensor (the axes parameters shard over; routed experts over
  expert too, `state_split`), activations over the batch axes data x fsdp x
  expert and the sequence over context (attention_impl=auto resolved for
  `platform`); a generation step holds parameters and the KV cache."""
  m, t = config.model, config.train
  param_split = state_split(config, mesh)
  rows_split = batch_split(mesh) * mesh.shape["context"]
  memory = accounting.training_memory_bytes(config, backend=platform)
  if step == "train":
    estimate = {"parameters": memory["parameters"] / param_split,
                "optimizer_state": memory["optimizer_state"] / param_split,
                "gradients": memory["gradients"] / param_split,
                "activations": memory["activations"] / rows_split}
  elif step == "eval":
    estimate = {"parameters": memory["parameters"] / param_split}
  else:
    estimate = {"parameters": memory["parameters"] / param_split,
                "kv_cache": accounting.kv_cache_bytes_per_token(m) * t.batch_size * t.seq_len
                            / rows_split}
  estimate["total"] = sum(estimate.values())
  return {name: int(value) for name, value in estimate.items()}


def _formula_flops(config, step: str, num_devices: int) -> float:
  """PaLM FLOPs per device: train 6N + 12 L S d_attn per token, eval a third;
  a generation step 2N + 4 L S d_attn per new token (S = the cache length)."""
  t = config.train
  if step == "generate":
    return accounting.flops_per_token(config.model, t.seq_len, train=False) * t.batch_size \
        / num_devices
  per_token = accounting.flops_per_token(config.model, t.seq_len, train=step == "train",
                                         mtp_depth=t.get("mtp_depth", 0))  # its modules run
  return per_token * t.batch_size * t.seq_len / num_devices


def _memory(compiled, held: dict) -> dict:
  """Bytes per device: `held` (shards of the inputs) and the compiler's memory analysis."""
  analysis = compiled.memory_analysis()
  memory = dict(held, arguments=analysis.argument_size_in_bytes,
                outputs=analysis.output_size_in_bytes, aliased=analysis.alias_size_in_bytes,
                temporaries=analysis.temp_size_in_bytes,
                code=analysis.generated_code_size_in_bytes)
  live = memory["arguments"] + memory["outputs"] - memory["aliased"]
  # libtpu may report no temporaries but its own peak; the larger of that peak and
  # live + temporaries + code is taken, and the rest of the peak counts as temporaries.
  memory["peak"] = max(getattr(analysis, "peak_memory_in_bytes", 0),
                       live + memory["temporaries"] + memory["code"])
  memory["temporaries"] = memory["temporaries"] or memory["peak"] - live - memory["code"]
  return memory


def out_of_memory_bytes(message: str) -> int | None:
  """The temporaries a TPU compile that ran out of HBM needed, from its error; else None.

  libtpu stops a program that cannot fit with "... memory required for HLO
  temporaries (616.45G) exceeds available HBM (95.74G)".
  """
  match = re.search(r"required for HLO temporaries \(([\d.]+)([KMGT]?)\)", message)
  if not match:
    return None
  return int(float(match.group(1)) * 1024 ** " KMGT".index(match.group(2) or " "))


def lower_on_mesh(config, mesh, step: str = "train"):
  """(the lowered `step`, bytes each device holds of its inputs) on `mesh`."""
  lower = {"train": _lower_train, "eval": _lower_eval, "generate": _lower_generate}[step]
  return lower(config, mesh)


def lower_step(config, target: Target, step: str = "train"):
  """(the lowered `step` of the run `config` over `target`'s devices, the bytes
  per device of its inputs, the mesh).

  Raises:
    UserError: a config or mesh that does not fit the target's device count,
      or a target whose compiler is not installed.
  """
  config = resolve(config)  # as train.py resolves it (num_steps: the schedule)
  mesh = make_mesh(config.mesh, target_devices(target))
  lowered, held = lower_on_mesh(config, mesh, step)
  return lowered, held, mesh


def compile_report(config, target: Target, *, step: str = "train") -> dict:
  """Compiles `step` of the run `config` for `target`; the report as a JSON-able dict.

  Raises:
    UserError: as `lower_step`.
  """
  start = time.perf_counter()
  lowered, held, mesh = lower_step(config, target, step)
  lowered_at = time.perf_counter()
  devices = list(mesh.devices.flat)
  try:
    compiled = lowered.compile()
  except jax.errors.JaxRuntimeError as e:
    needed = out_of_memory_bytes(str(e))
    if needed is None:
      raise
    compiled = None
  seconds = time.perf_counter() - start

  if compiled is None:  # the compiler refused: what it needed is all it says
    arguments = sum(held.values())
    memory = dict(held, arguments=arguments, outputs=None, aliased=None, temporaries=needed,
                  code=None, peak=arguments + needed)
  else:
    memory = _memory(compiled, held)
  chip = target.chip
  fits = compiled is not None and memory["peak"] <= chip.hbm_bytes

  cost = cost_analysis(compiled) if compiled is not None else {}
  hlo_text = compiled.as_text() if compiled is not None else ""
  looped = has_loops(hlo_text)
  flops, hbm_bytes = (None, None) if looped else (cost.get("flops"), cost.get("bytes accessed"))
  found = collectives(hlo_text)
  traffic = sum(c["traffic_bytes"] for c in found.values())
  formula = _formula_flops(config, step, len(devices))
  times = {"compute": (flops or formula) / chip.peak_flops,
           "hbm": hbm_bytes / chip.hbm_bandwidth if hbm_bytes else None,
           "interconnect": traffic / chip.interconnect_bandwidth if compiled else None}
  bound = max(t for t in times.values() if t is not None)
  verdict = (f"fits: {memory['peak'] / 2**30:.2f} GiB of {chip.hbm_bytes / 2**30:.1f} GiB HBM "
             f"per device ({100 * memory['peak'] / chip.hbm_bytes:.0f}%)" if fits else
             f"does NOT fit: needs {memory['peak'] / 2**30:.2f} GiB per device, the chip has "
             f"{chip.hbm_bytes / 2**30:.1f} GiB HBM"
             + ("" if compiled else " (the compiler stopped at its temporaries)"))
  return {
      "target": target.name, "device_kind": devices[0].device_kind, "devices": len(devices),
      "mesh": dict(mesh.shape), "step": step, "compiled": compiled is not None,
      "compile_seconds": round(seconds, 2),  # tracing and lowering (ours), then XLA's compile
      "lower_seconds": round(lowered_at - start, 2),
      "batch_size": config.train.batch_size, "seq_len": config.train.seq_len,
      "params_total": accounting.formula_params(config.model)["params_total"],
      "memory_per_device": memory,
      "accounting_per_device": _accounting(config, mesh, step, chip.platform),
      "hbm_bytes": chip.hbm_bytes, "fits": fits, "verdict": verdict,
      "flops_per_device": flops, "formula_flops_per_device": formula,
      "hbm_bytes_accessed_per_device": hbm_bytes,
      "loop_bodies_once": ({"flops": cost.get("flops"),
                            "bytes_accessed": cost.get("bytes accessed")} if looped else None),
      "collectives": found,
      "async_overlap": async_overlap(hlo_text),
      "kernels": kernels(hlo_text),
      "roofline_seconds": times, "step_seconds_bound": bound,
      "mfu_bound": formula / (bound * chip.peak_flops) if compiled and bound > 0 else None,
      "chip": {"peak_flops": chip.peak_flops, "hbm_bandwidth": chip.hbm_bandwidth,
               "interconnect_bandwidth": chip.interconnect_bandwidth, "source": chip.source},
      "context_attention_flops_per_device": _context_attention(config, mesh, step),
  }


def _context_attention(config, mesh, step: str) -> dict | None:
  """With mesh.context > 1, a train step's causal attention FLOPs on each
  device of the context axis (its rows' share, `accounting.context_attention_flops`),
  zig-zag as the model lays rows out and, for comparison, the contiguous
  split; None otherwise."""
  n = mesh.shape["context"]
  if n == 1 or step != "train":
    return None
  rows = config.train.batch_size // batch_split(mesh)
  per_row = accounting.context_attention_flops(config.model, config.train.seq_len, n)
  return {layout: [rows * f for f in flops] for layout, flops in per_row.items()}


def _size(n: float) -> str:
  return f"{n / 2**30:9.2f} GiB" if n >= 2**30 else f"{n / 2**20:9.2f} MiB"


def _number(x, scale: float = 1.0, spec: str = ".4g") -> str:
  """`x * scale` formatted, or "n/a" where the compiler gives no number."""
  return "n/a" if x is None else format(x * scale, spec)


def format_report(report: dict) -> str:
  """The report as the table compile.py prints."""
  mesh = " ".join(f"{axis}={size}" for axis, size in report["mesh"].items())
  mem, est = report["memory_per_device"], report["accounting_per_device"]
  lines = [f"{report['step']} step, batch {report['batch_size']} x {report['seq_len']}, "
           f"{report['params_total']:,} parameters, on {report['target']} "
           f"({report['devices']} x {report['device_kind']}), mesh {mesh}; compiled in "
           f"{report['compile_seconds']:.1f} s ({report['lower_seconds']:.1f} s tracing and "
           "lowering)",
           "", f"memory per device        {'compiler':>13}  {'model.accounting':>16}"]
  rows = [("parameters", mem["parameters"], est.get("parameters")),
          ("optimizer state", mem["optimizer_state"], est.get("optimizer_state")),
          ("gradients", None, est.get("gradients")),
          ("kv cache", mem.get("kv_cache"), est.get("kv_cache")),
          ("batch", mem["batch"], None),
          ("arguments", mem["arguments"], None), ("outputs", mem["outputs"], None),
          ("donated (aliased)", mem["aliased"], None),
          ("temporaries", mem["temporaries"], est.get("activations")),
          ("peak / total", mem["peak"], est["total"])]
  for name, compiler, estimate in rows:
    if compiler is None and estimate is None:
      continue
    left = _size(compiler) if compiler is not None else f"{'-':>13}"
    right = _size(estimate) if estimate is not None else "-"
    lines.append(f"  {name:<22} {left}  {right:>16}")
  lines.append("  (model.accounting's activations stand beside the compiler's temporaries, "
               "which also hold gradients and workspace)" if report["step"] == "train" else "")
  lines += [f"verdict: {report['verdict']}", "",
            f"FLOPs per device per step: compiler {_number(report['flops_per_device'])}, "
            f"PaLM formula {report['formula_flops_per_device']:.4g}"
            + (" (the program loops over its layers: the compiler's cost analysis counts "
               "each loop body once, so the roofline uses the formula and no HBM term)"
               if report["loop_bodies_once"] else ""),
            "collectives per device per step:"]
  context = report["context_attention_flops_per_device"]
  if context:
    zigzag, contiguous = context["zigzag"], context["contiguous"]
    lines[-1:-1] = [f"attention FLOPs per device of the context axis (causal): "
                    f"{max(zigzag):.4g} on each with the zig-zag layout (max/mean "
                    f"{max(zigzag) * len(zigzag) / sum(zigzag):.3f}); a contiguous split's "
                    f"busiest {max(contiguous):.4g} (max/mean "
                    f"{max(contiguous) * len(contiguous) / sum(contiguous):.3f})"]
  if not report["collectives"]:
    lines.append("  none")
  for kind, c in report["collectives"].items():
    overlap = report["async_overlap"].get(kind)
    lines.append(f"  {kind:<20} {c['count']:5d} x, {_size(c['bytes'])} results, "
                 f"{_size(c['traffic_bytes'])} through the links"
                 + (f"; {overlap['async']} asynchronous, {overlap['overlapped']} of them "
                    "with compute between start and done" if overlap else ""))
  lines.append("Pallas kernels in the compiled program (per-device shapes, operands -> "
               "results):")
  if not report["compiled"]:
    lines.append("  not read: the compiler refused the program")
  elif not report["kernels"]:
    lines.append("  none: attention runs as XLA ops")
  for name, k in report["kernels"].items():
    lines.append(f"  {name:<32} {k['lowering']:<10} {k['count']:3d} x, "
                 f"{' '.join(k['operands']) or '?'} -> {' '.join(k['results'])}")
  times = report["roofline_seconds"]
  mfu = report["mfu_bound"]
  lines += ["", "roofline per step: " + ", ".join(f"{name} {_number(s, 1e3, '.3f')} ms"
                                                    for name, s in times.items())
            + f" -> step >= {1e3 * report['step_seconds_bound']:.3f} ms, MFU <= "
            + (f"{100 * mfu:.1f}%" if mfu is not None else "-"),
            f"chip numbers: {report['chip']['source']}"]
  return "\n".join(lines)
