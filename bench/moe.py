"""Mixture-of-experts grouped matmuls beside a dense MLP of the same active FLOPs.

Each case is N tokens of width d and E experts of hidden width f with the
case's `model.mlp` kind (gated kinds: 3 matrices, plain: 2), every token
routed to k experts; inputs and weights bfloat16, the products in bfloat16
with float32 outputs, as `model/moe.py`'s `grouped_mlp` runs them. Three
implementations, each timed forward and forward+backward (`jax.vjp`: the
output and its gradients, for a cotangent of ones, wrt the inputs and every
weight):

- `dense`: one MLP of hidden width k f on the N tokens (`dense_mlp`:
  `grouped_mlp` with plain dots), the same matmul FLOPs a token;
- `grouped`: `grouped_mlp` alone (three or two `jax.lax.ragged_dot`) on the
  N k rows already sorted by expert, with their group sizes;
- `moe_layer`: `moe_tokens`, the whole token path: router matmul, softmax
  top k (renormalised), sort by expert, grouped MLP, scatter back and
  weighted sum; dropless.

The assignments come from a random router, [d, E] of N(0, 1/d) on tokens of
N(0, 1) (logits about N(0, 1)), so the experts' loads are roughly balanced:
`load` is the largest group over the mean. `grouped` times the groups that
`moe_layer` makes.

Cases: `gpt2-small` (N 8192, d 768, E 8, k 2, f 3072, gelu_tanh),
`fine-grained` (N 8192, d 2048, E 64, k 8, f 1024, swiglu: Qwen-MoE and
DeepSeek-MoE style), `top1` (N 8192, d 2048, E 8, k 1, f 8192, swiglu);
with `--quick` the same at toy sizes.

FLOPs are nominal, the matmuls of a token's k experts: forward = matrices x
2 N k d f (the router's 2 N d E not counted), forward+backward = 3 x
forward; every implementation gets the same count, so TFLOP/s compare as
times do, and `÷ dense` is the time over `dense`'s. `XLA FLOPs ÷ nominal`
(fwd+bwd) is the compiled program's `cost_analysis` FLOPs over that count:
about 1 for `dense`, about E where `ragged_dot` runs as dense dots over the
groups zero-padded to all the rows (JAX's lowering on CPU; XLA:GPU's where
no grouped-GEMM backend takes it); under 1 where XLA's cost model cannot see
into a library call. `ragged-dot kept`: the `ragged-dot` instructions left in
the compiled program (0: every one became dense dots).

Times are the median of --repeats runs after --warmup, each ended by
`block_until_ready`, of programs compiled beforehand (a case's six at once,
in threads of their own). Past --deadline_s (default 40) seconds from the
start the remaining measurements are skipped (their cells say so), and the
JSON (--out) is rewritten after every case.

  python -m bench.moe --out bench/results/moe-<date>.json   # GPU
  python -m bench.moe --quick                               # CPU check
"""
import argparse
import concurrent.futures
import datetime
import functools
import json
import pathlib
import time

import jax
import jax.numpy as jnp

from bench.attention import short_error, time_median
from bench.bench_utils import command_line, git_commit
from model.mlp import MLPS
from model.moe import grouped_mlp, moe_tokens, route, sort_by_expert

DTYPE = jnp.bfloat16
IMPLS = ("dense", "grouped", "moe_layer")
MODES = ("fwd", "fwd_bwd")


def cases(quick: bool) -> list[dict]:
  """The shapes to time: label, N tokens, d model width, E experts, k experts
  a token, f expert width, mlp kind."""
  if quick:
    sizes = [(64, 32, 4, 2, 32), (64, 32, 8, 4, 16), (64, 32, 2, 1, 64)]
  else:
    sizes = [(8192, 768, 8, 2, 3072), (8192, 2048, 64, 8, 1024), (8192, 2048, 8, 1, 8192)]
  return [dict(label=label, N=N, d=d, E=E, k=k, f=f, mlp=mlp)
          for label, mlp, (N, d, E, k, f) in zip(
              ("gpt2-small", "fine-grained", "top1"), ("gelu_tanh", "swiglu", "swiglu"), sizes)]


def nominal_flops(case: dict) -> float:
  """Forward FLOPs of the experts' matmuls: matrices x 2 N k d f."""
  return (MLPS[case["mlp"]].matrices * 2.0 * case["N"] * case["k"] * case["d"]
          * case["f"])


def dense_mlp(x_NM, up_MF, gate_MF, down_FM, *, activation, dtype):
  """`grouped_mlp` of one expert taking every row: plain dots in `dtype`,
  float32 out."""
  dot = lambda a, w: jnp.dot(a.astype(dtype), w.astype(dtype), preferred_element_type=dtype)
  if gate_MF is not None:
    h_NF = activation(dot(x_NM, gate_MF)) * dot(x_NM, up_MF)
  else:
    h_NF = activation(dot(x_NM, up_MF))
  return dot(h_NF, down_FM).astype(jnp.float32)


def make_inputs(case: dict, seed: int = 0) -> dict:
  """Tokens x [N, d] of N(0, 1), the router [d, E], the experts' (up, gate,
  down) [E, d, f], [E, d, f], [E, f, d] and the dense MLP's [d, k f],
  [d, k f], [k f, d] (gate None when not gated), each N(0, 1 / fan-in);
  all bfloat16."""
  N, d, E, k, f = (case[n] for n in "NdEkf")
  gated = MLPS[case["mlp"]].gated

  def build(key):
    keys = iter(jax.random.split(key, 8))

    def normal(shape, fan_in):
      return (jax.random.normal(next(keys), shape) * fan_in ** -0.5).astype(DTYPE)
    return dict(x=normal((N, d), 1), router=normal((d, E), d),
                experts=(normal((E, d, f), d), normal((E, d, f), d) if gated else None,
                         normal((E, f, d), f)),
                dense=(normal((d, k * f), d), normal((d, k * f), d) if gated else None,
                       normal((k * f, d), k * f)))
  return jax.jit(build)(jax.random.key(seed, impl="rbg"))  # rbg: quick to compile


@functools.partial(jax.jit, static_argnums=2)
def sorted_rows(x_NM, router_ME, k: int):
  """(rows [N k, d] sorted by expert, group sizes [E]), as `moe_tokens`
  routes and sorts them."""
  logits_NE = jnp.dot(x_NM.astype(jnp.float32), router_ME.astype(jnp.float32))
  _, experts_NK, _ = route(logits_NE, k, normalize=True)
  order_A, groups_E, _ = sort_by_expert(experts_NK.reshape(-1), router_ME.shape[1], None)
  return x_NM[order_A // k], groups_E


def implementations(case: dict, inputs: dict) -> dict:
  """name -> (fn, fixed, diff): fn(fixed, *diff) is the float32 output; the
  backward takes the gradients wrt `diff`."""
  opts = dict(activation=MLPS[case["mlp"]].activation, dtype=DTYPE)
  x, router, experts = inputs["x"], inputs["router"], inputs["experts"]
  rows, groups = sorted_rows(x, router, case["k"])
  return {
      "dense": (lambda _, x, w: dense_mlp(x, *w, **opts), None, (x, inputs["dense"])),
      "grouped": (lambda g, rows, w: grouped_mlp(rows, g, *w, **opts), groups, (rows, experts)),
      "moe_layer": (lambda _, x, r, w: moe_tokens(x, r, *w, k=case["k"], normalize=True,
                                                  **opts)[0], None, (x, router, experts)),
  }


def step(fn, mode: str):
  """`fn` itself (fwd), or (fixed, *diff, dy) -> (output, the gradients wrt
  diff) (fwd_bwd)."""
  if mode == "fwd":
    return fn

  def fwd_bwd(fixed, *args):
    *diff, dy = args
    out, vjp = jax.vjp(functools.partial(fn, fixed), *diff)
    return out, vjp(dy)
  return fwd_bwd


def compile_all(programs: list) -> list:
  """Each (fn, args) lowered here and compiled in a thread of its own (XLA
  compiles outside the GIL), those that fail once more one at a time (the
  autotuning of all at once may run out of GPU memory); the exception where
  one fails."""
  def compile_one(lowered):
    try:
      return lowered if isinstance(lowered, Exception) else lowered.compile()
    except Exception as exc:  # pylint: disable=broad-except
      return exc
  lowered = []
  for fn, args in programs:
    try:
      lowered.append(jax.jit(fn).lower(*args))
    except Exception as exc:  # pylint: disable=broad-except
      lowered.append(exc)
  with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
    compiled = list(pool.map(compile_one, lowered))
  return [compile_one(l) if isinstance(c, Exception) else c for l, c in zip(lowered, compiled)]


def measure(compiled, args, flops: float, warmup: int, repeats: int) -> dict:
  """ms, TFLOP/s (of `flops`), XLA's FLOPs over `flops` and the ragged-dot
  instructions kept, of a compiled program on `args`; or the error."""
  try:
    if isinstance(compiled, Exception):
      raise compiled
    seconds = time_median(compiled, args, warmup, repeats)
  except Exception as exc:  # pylint: disable=broad-except
    return dict(error=short_error(exc))
  xla_flops = (compiled.cost_analysis() or {}).get("flops", 0.0)
  return dict(ms=seconds * 1e3, tflops=flops / seconds / 1e12, xla_flops_ratio=xla_flops / flops,
              ragged_dots=compiled.as_text().count("ragged-dot("))


def measure_case(case: dict, warmup: int, repeats: int, deadline: float) -> list[dict]:
  """One row an implementation: `case` (with its nominal FLOPs and load) and
  fwd / fwd_bwd results, each with its time over `dense`'s. The case's six
  programs compile together first; those not timed by `deadline`
  (time.perf_counter()) are skipped."""
  inputs = make_inputs(case)
  impls = implementations(case, inputs)
  groups = impls["grouped"][1]
  case = dict(case, flops=nominal_flops(case), load=float(groups.max() / groups.mean()))
  jobs = []  # (name, mode, fn, args, FLOPs)
  for name, (fn, fixed, diff) in impls.items():
    out = jax.eval_shape(fn, fixed, *diff)
    dy = jnp.ones(out.shape, out.dtype)
    jobs += [(name, "fwd", fn, (fixed, *diff), case["flops"]),
             (name, "fwd_bwd", step(fn, "fwd_bwd"), (fixed, *diff, dy), 3 * case["flops"])]
  skipped = dict(error="skipped: past --deadline_s")
  compiled = (compile_all([(fn, args) for _, _, fn, args, _ in jobs])
              if time.perf_counter() < deadline else [None] * len(jobs))
  rows = {name: dict(case=case, impl=name) for name in impls}
  for (name, mode, _, args, flops), program in zip(jobs, compiled):
    rows[name][mode] = (measure(program, args, flops, warmup, repeats)
                        if time.perf_counter() < deadline else skipped)
  for row in rows.values():
    for mode in MODES:
      if "ms" in row[mode] and "ms" in rows["dense"][mode]:
        row[mode]["vs_dense"] = row[mode]["ms"] / rows["dense"][mode]["ms"]
  return list(rows.values())


def table(rows: list[dict]) -> str:
  """The rows as markdown, a line each."""
  lines = ["| case | impl | fwd ms | fwd TFLOP/s | fwd ÷ dense | fwd+bwd ms | fwd+bwd TFLOP/s "
           "| fwd+bwd ÷ dense | XLA FLOPs ÷ nominal | ragged-dot kept |", "|---" * 10 + "|"]
  for row in rows:
    c = row["case"]
    cells = [f"{c['label']} (N {c['N']}, d {c['d']}, E {c['E']}, k {c['k']}, f {c['f']}, "
             f"{c['mlp']}, load {c['load']:.2f})", row["impl"]]
    for mode in MODES:
      r = row[mode]
      cells += ([r["error"], "", ""] if "error" in r else
                [f"{r['ms']:.3f}", f"{r['tflops']:.3g}", f"{r.get('vs_dense', float('nan')):.2f}"])
    r = row["fwd_bwd"]
    cells += (["", ""] if "error" in r else [f"{r['xla_flops_ratio']:.2f}", str(r["ragged_dots"])])
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def main(argv=None) -> dict:
  """Runs the cases, prints the table, writes --out; returns the report."""
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="toy shapes, for a CPU")
  parser.add_argument("--out", type=pathlib.Path, help="write JSON here")
  parser.add_argument("--warmup", type=int, help="default 3 (--quick: 1)")
  parser.add_argument("--repeats", type=int, help="default 10 (--quick: 2)")
  parser.add_argument("--deadline_s", type=float, default=40.0,
                      help="skip the measurements not started this many seconds in")
  args = parser.parse_args(argv)
  deadline = time.perf_counter() + args.deadline_s
  warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
  repeats = args.repeats if args.repeats is not None else (2 if args.quick else 10)
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              device=jax.devices()[0].device_kind, backend=jax.default_backend(),
              jax=jax.__version__, commit=git_commit(), command=command_line(),
              warmup=warmup, repeats=repeats, dtype="bfloat16",
              router="random: router [d, E] of N(0, 1/d) on tokens of N(0, 1)",
              flops="fwd = matrices x 2 N k d f; fwd_bwd = 3 x fwd")
  print(f"# MoE grouped matmuls: {meta['device']} ({meta['backend']}), jax {meta['jax']}, "
        f"commit {meta['commit']}, {meta['date']}")
  print(f"# median of {repeats} after {warmup} warm-up\n", flush=True)
  report = dict(meta=meta, rows=[])
  for case in cases(args.quick):
    report["rows"] += measure_case(case, warmup, repeats, deadline)
    lines = table(report["rows"]).splitlines()
    print("\n".join(lines[-len(IMPLS):] if len(report["rows"]) > len(IMPLS) else lines),
          flush=True)
    if args.out:
      args.out.write_text(json.dumps(report, indent=2))
  if args.out:
    print(f"\nwrote {args.out}")
  return report


if __name__ == "__main__":
  main()
