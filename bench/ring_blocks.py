"""The context-parallel ring's kernel calls on one device, against the plain kernel.

A ring of one device is the plain kernel (`model/context_parallel.py` is not
entered with `mesh.context=1`). With n devices and the zig-zag layout, each
device holds T = L / n queries and keys of a causal row of L tokens and, over
the ring's n steps, makes three kinds of call to our kernels through
`flash_attention_parts` (the forward returning its log-sum-exp, the backward
from a given (out, lse)), `KernelBlocks`:

- `diagonal`: its own block, causal, q T x k T (one step);
- `before`: keys from a device before it, non-causal, q T x k T/2;
- `after`: keys from a device after it, non-causal, q T/2 x k T
  (i + (n-1-i) = n - 1 steps of these two kinds in all).

For each call the table gives forward (with lse) and backward (from the
forward's out and lse) times, and the same shapes through the plain
`flash_attention` (forward, and forward + backward by `jax.vjp`): what
returning the lse and the split backward cost. `ring` is one device's
attention compute over the whole ring, t(diagonal) + (n-1)/2 (t(before) +
t(after)), against `whole / n`, the plain causal kernel on the whole row
divided over n devices: the ring's compute efficiency before any transfer
(the hops are not timed here; `bench.context_parallel` times whole steps on
a mesh). TFLOP/s as `bench.attention`'s (forward 4 B T S H D, halved when
causal; backward 2.5 x forward).

  python -m bench.ring_blocks --out bench/results/ring_blocks-<date>.json   # GPU
  python -m bench.ring_blocks --quick                                       # CPU check
"""
import argparse
import datetime
import json
import pathlib

import jax

from bench.attention import make_inputs, time_median
from bench.bench_utils import command_line, git_commit
from model.kernels.router import flash_attention, flash_attention_parts


def ring_cases(quick: bool) -> list[dict]:
  """(row length L, ring size n, heads H, KV heads K, head_dim D) to time."""
  if quick:
    return [dict(L=128, n=2, H=2, K=1, D=64)]
  return [dict(L=65536, n=8, H=16, K=8, D=128)]


def calls(case: dict) -> dict:
  """The three calls' (T, S, causal) for one device's block of the ring."""
  T = case["L"] // case["n"]
  return {"diagonal": (T, T, True), "before": (T, T // 2, False), "after": (T // 2, T, False)}


def flops(T: int, S: int, causal: bool, H: int, D: int) -> float:
  """Forward FLOPs of one call (B = 1), halved when causal."""
  return 4.0 * T * S * H * D / (2 if causal else 1)


def _inputs(T: int, S: int, case: dict):
  """q and dO [1, T, H, D], k and v [1, S, K, D], bfloat16."""
  H, K, D = case["H"], case["K"], case["D"]
  q, _, _, do = make_inputs(dict(B=1, S=T, H=H, K=K, D=D), seed=1)
  _, k, v, _ = make_inputs(dict(B=1, S=S, H=H, K=K, D=D), seed=2)
  return q, k, v, do


def time_plain(T: int, S: int, causal: bool, case: dict, lowering: str | None, warmup: int,
               repeats: int) -> dict:
  """ms of the plain kernel's forward and forward + backward at these shapes."""
  q, k, v, do = _inputs(T, S, case)
  plain = lambda q, k, v: flash_attention(q, k, v, causal=causal, lowering=lowering)

  def plain_grads(q, k, v, do):
    _, vjp = jax.vjp(plain, q, k, v)
    return vjp(do)

  ms = lambda fn, *args: 1e3 * time_median(fn, args, warmup, repeats)
  return dict(plain_fwd=ms(jax.jit(plain), q, k, v),
              plain_fwd_bwd=ms(jax.jit(plain_grads), q, k, v, do))


def time_call(T: int, S: int, causal: bool, case: dict, lowering: str | None, warmup: int,
              repeats: int) -> dict:
  """ms of the parts' forward and backward, and `time_plain`'s, at one call's
  shapes."""
  q, k, v, do = _inputs(T, S, case)
  parts = flash_attention_parts(q, k, causal=causal, lowering=lowering)
  forward = jax.jit(lambda q, k, v: parts.forward(q, k, v, None, None))
  backward = jax.jit(lambda q, k, v, out, lse, do: parts.backward(q, k, v, None, None, out, lse,
                                                                   do))
  out, lse = forward(q, k, v)
  ms = lambda fn, *args: 1e3 * time_median(fn, args, warmup, repeats)
  return dict(T=T, S=S, causal=causal,
              parts_fwd=ms(forward, q, k, v), parts_bwd=ms(backward, q, k, v, out, lse, do),
              **time_plain(T, S, causal, case, lowering, warmup, repeats))


def measure(case: dict, lowering: str | None, warmup: int, repeats: int) -> dict:
  """Every call of `case`, the ring's total and the whole row's plain kernel."""
  n, H, D = case["n"], case["H"], case["D"]
  row = dict(case=case, lowering=lowering, calls={})
  for name, (T, S, causal) in calls(case).items():
    row["calls"][name] = r = time_call(T, S, causal, case, lowering, warmup, repeats)
    r["fwd_tflops"] = flops(T, S, causal, H, D) / r["parts_fwd"] / 1e9
    r["bwd_tflops"] = 2.5 * flops(T, S, causal, H, D) / r["parts_bwd"] / 1e9
  c = row["calls"]
  side = (n - 1) / 2
  row["ring_ms"] = (c["diagonal"]["parts_fwd"] + c["diagonal"]["parts_bwd"] + side * (
      c["before"]["parts_fwd"] + c["before"]["parts_bwd"]
      + c["after"]["parts_fwd"] + c["after"]["parts_bwd"]))
  whole = time_plain(case["L"], case["L"], True, case, lowering, warmup, repeats)
  row["whole_fwd_bwd_ms"] = whole["plain_fwd_bwd"]
  row["efficiency"] = whole["plain_fwd_bwd"] / n / row["ring_ms"]
  return row


def table(rows: list[dict]) -> str:
  lines = ["| L | n | H/K | D | lowering | call | q x k | parts fwd / bwd ms | plain fwd / "
           "fwd+bwd ms | parts TFLOP/s fwd / bwd |", "|---|---|---|---|---|---|---|---|---|---|"]
  for row in rows:
    c = row["case"]
    head = f"| {c['L']} | {c['n']} | {c['H']}/{c['K']} | {c['D']} | {row['lowering'] or 'auto'}"
    for name, r in row["calls"].items():
      lines.append(f"{head} | {name} | {r['T']} x {r['S']}{' causal' if r['causal'] else ''} | "
                   f"{r['parts_fwd']:.3g} / {r['parts_bwd']:.3g} | {r['plain_fwd']:.3g} / "
                   f"{r['plain_fwd_bwd']:.3g} | {r['fwd_tflops']:.3g} / {r['bwd_tflops']:.3g} |")
    lines.append(f"{head} | ring (one device) | {c['L']} / {c['n']} | {row['ring_ms']:.3g} "
                 f"fwd+bwd | whole / n: {row['whole_fwd_bwd_ms'] / c['n']:.3g} | "
                 f"efficiency {row['efficiency']:.2f} |")
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="tiny shapes; the CPU interpreter")
  parser.add_argument("--lowerings", nargs="+", default=None,
                      help="mosaic_gpu, triton, mosaic_tpu (default: the router's choice)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--out", type=pathlib.Path, help="write JSON here")
  args = parser.parse_args()
  meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
              device=jax.devices()[0].device_kind, backend=jax.default_backend(),
              jax=jax.__version__, commit=git_commit(), command=command_line(),
              warmup=args.warmup, repeats=args.repeats, dtype="bfloat16")
  print(f"# Ring blocks: {meta['device']} ({meta['backend']}), jax {meta['jax']}, "
        f"commit {meta['commit']}, {meta['date']}", flush=True)
  rows = []
  for lowering in args.lowerings or [None]:
    for case in ring_cases(args.quick):
      rows.append(measure(case, lowering, args.warmup, args.repeats))
      lines = table(rows).splitlines()
      print("\n".join(lines if len(rows) == 1 else lines[-len(rows[-1]["calls"]) - 1:]),
            flush=True)
      if args.out:  # after every row: a run stopped by its time limit keeps what it measured
        args.out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2))
  if args.out:
    print(f"\nwrote {args.out}")
  return rows


if __name__ == "__main__":
  main()
