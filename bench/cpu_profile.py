"""Where a CPU training step's time goes, ours beside torch's, op by op.

`python -m bench.vs_torch --parts profile` runs it (see bench/vs_torch.py):
a few steps of each side under its profiler, every op's time put in one of
`CATEGORIES`, per step.

Ours: a `jax.profiler` trace of the steps (XLA's CPU runtime records each
thunk, a fusion or a library call, by its HLO name) and the compiled HLO
text, whose metadata names the JAX scope each instruction came from. The
model marks its scopes (`jax.named_scope`: `attention`, `activation`,
`norm`, `loss`, `logits`, `optimizer`); autodiff keeps them on the backward
ops. Thunks run on the runtime's threads, two at a time on two cores, so the
categories can add up to more than the step's wall time. Tracing every
thunk slows our step down (by about half at this size), so the table puts
each side's step time measured without its profiler beside the sum of its
ops; the difference is dispatch, Python and thread hand-offs (less the
overlap of thunks on two threads).

Torch: `torch.profiler` self CPU time of every op (so nothing counts
twice), by the op's name, and the optimizer as the ops under our
`optimizer` range (`TorchTrainer.step`).

`attention_times` times the attention alone, forward and backward, for our
implementations beside torch's `scaled_dot_product_attention`: the table
that `model.attention.auto_implementation`'s CPU rule rests on.
"""
import collections
import gzip
import json
import pathlib
import re
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.nn.functional as F

from model.attention import AttentionOptions, attention

CATEGORIES = ("matmuls", "attention", "activation", "norms", "loss", "optimizer",
              "layout copies", "other")
CATEGORY_DOC = {
    "matmuls": "projections, MLP and logits matrix products, forward and backward",
    "attention": "Q K^T, mask, softmax, times V, forward and backward",
    "activation": "GELU / SwiGLU and their derivatives",
    "norms": "LayerNorm / RMSNorm and their derivatives",
    "loss": "log-softmax cross-entropy over the vocabulary",
    "optimizer": "gradient norm, clipping, AdamW update",
    "layout copies": "transposes and copies XLA inserts between ops",
    "other": "embedding gather and scatter, residual adds, RoPE, everything else",
}
_SCOPES = (("/attention", "attention"), ("/activation", "activation"), ("/norm", "norms"),
           ("/loss", "loss"), ("/optimizer", "optimizer"))


def hlo_ops(hlo_text: str) -> dict[str, tuple[str, str]]:
  """{instruction name: (opcode, JAX op_name)} over every computation of the
  compiled HLO text; a fusion's opcode is `fusion`, its op_name its root's."""
  ops = {}
  for line in hlo_text.splitlines():
    m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*? ([\w\-]+)\(", line)
    if m:
      name = re.search(r'op_name="([^"]*)"', line)
      ops[m.group(1)] = (m.group(2), name.group(1) if name else "")
  return ops


def jax_category(name: str, opcode: str, op_name: str) -> str:
  """The category of our thunk `name` (an HLO instruction)."""
  scope = next((c for s, c in _SCOPES if s in op_name or s.replace("/", "(") in op_name), None)
  if scope is not None:
    return scope
  if name.startswith(("copy", "transpose")) or opcode in ("copy", "transpose"):
    return "layout copies"
  if opcode == "dot" or op_name.endswith("dot_general") or "->" in op_name.rsplit("/", 1)[-1]:
    return "matmuls"
  return "other"


def profile_ours(step, batches, hlo_text: str) -> dict:
  """Per-step milliseconds by category of our `step(batch)` over `batches`
  (already compiled and warm), from a jax.profiler trace."""
  ops = hlo_ops(hlo_text)
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    try:
      for batch in batches:
        step(batch)
    finally:
      jax.profiler.stop_trace()
    trace = next(pathlib.Path(trace_dir).rglob("*.trace.json.gz"))
    events = json.load(gzip.open(trace))
  events = events["traceEvents"] if isinstance(events, dict) else events
  ms = collections.defaultdict(float)
  top = collections.Counter()
  for e in events:
    if e.get("ph") != "X" or e["name"] not in ops:
      continue
    opcode, op_name = ops[e["name"]]
    category = jax_category(e["name"], opcode, op_name)
    ms[category] += e["dur"] / 1e3
    top[(e["name"], category, op_name)] += e["dur"] / 1e3
  n = len(batches)
  return {"ms": {c: ms[c] / n for c in CATEGORIES},
          "top": [{"op": k[0], "category": k[1], "scope": k[2], "ms": v / n}
                  for k, v in top.most_common(15)]}


_TORCH_NAMES = (("scaled_dot_product", "attention"), ("ScaledDotProduct", "attention"),
                ("gelu", "activation"), ("Gelu", "activation"), ("silu", "activation"),
                ("Silu", "activation"), ("layer_norm", "norms"), ("LayerNorm", "norms"),
                ("rms_norm", "norms"), ("RmsNorm", "norms"), ("log_softmax", "loss"),
                ("LogSoftmax", "loss"), ("nll_loss", "loss"), ("NllLoss", "loss"),
                ("aten::mm", "matmuls"), ("aten::addmm", "matmuls"), ("aten::bmm", "matmuls"),
                ("MmBackward", "matmuls"), ("aten::copy_", "layout copies"),
                ("aten::clone", "layout copies"), ("aten::contiguous", "layout copies"))


def torch_category(event) -> str:
  """The category of a torch.profiler event: under our `optimizer` range, or
  by its name."""
  parent = event
  while parent is not None:
    if parent.name == "optimizer":
      return "optimizer"
    parent = parent.cpu_parent
  return next((c for pattern, c in _TORCH_NAMES if pattern in event.name), "other")


def profile_torch(step, batches) -> dict:
  """Per-step milliseconds by category of torch's `step(batch)` over `batches`."""
  with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    for batch in batches:
      step(batch)
  n = len(batches)
  ms = collections.defaultdict(float)
  top = collections.Counter()
  for event in prof.events():
    category = torch_category(event)
    ms[category] += event.self_cpu_time_total / 1e3
    top[(event.name, category)] += event.self_cpu_time_total / 1e3
  return {"ms": {c: ms[c] / n for c in CATEGORIES},
          "top": [{"op": k[0], "category": k[1], "ms": v / n} for k, v in top.most_common(15)]}


def profile_table(reports: list[dict]) -> str:
  """Markdown: per model, each category's ms/step for ours and torch, their
  sum, and the step's wall time without a profiler."""
  lines = ["| model | category | ours ms/step | torch ms/step | ours - torch |",
           "|---|---|---:|---:|---:|"]
  for r in reports:
    rows = [(c, r["ours"]["ms"][c], r["torch"]["ms"][c]) for c in CATEGORIES]
    rows.append(("all ops", sum(r["ours"]["ms"].values()), sum(r["torch"]["ms"].values())))
    rows.append(("step, wall, no profiler", r["ours"]["step_ms"], r["torch"]["step_ms"]))
    for c, a, b in rows:
      lines.append(f"| {r['model']} | {c} | {a:.1f} | {b:.1f} | {a - b:+.1f} |")
  return "\n".join(lines)


# Attention alone.

# group: query heads per KV head.
ATTENTION_CASES = {
    "MHA, causal": dict(group=1, packed=False),
    "GQA (2 query heads per KV head), causal": dict(group=2, packed=False),
    "MHA, causal, packed": dict(group=1, packed=True),
}


def attention_times(*, batch: int, seq: int, heads: int, head_dim: int, repeats: int,
                    implementations=("reference", "xla")) -> list[dict]:
  """Median ms of forward + backward of attention over float32 [batch, seq,
  heads, head_dim] queries, per `ATTENTION_CASES` entry: ours with each of
  `implementations`, and torch's scaled_dot_product_attention (is_causal, or
  a boolean mask for packed rows; K/V repeated per query head for GQA,
  whose `enable_gqa` path is slower), alternating."""
  rng = np.random.default_rng(0)
  rows = []
  for case, spec in ATTENTION_CASES.items():
    K = heads // spec["group"]
    q, dout = (rng.standard_normal((batch, seq, heads, head_dim), np.float32) for _ in range(2))
    k, v = (rng.standard_normal((batch, seq, K, head_dim), np.float32) for _ in range(2))
    seg = (np.cumsum(rng.random((batch, seq)) < 4 / seq, axis=1) + 1).astype(np.int32) \
        if spec["packed"] else None
    runs = {}
    for impl in implementations:
      def loss_grads(q, k, v, impl=impl):
        out, vjp = jax.vjp(lambda q, k, v: attention(
            q, k, v, AttentionOptions(causal=True, segment_ids=seg), implementation=impl),
            q, k, v)
        return vjp(jnp.asarray(dout))
      fn = jax.jit(loss_grads)
      args = tuple(map(jnp.asarray, (q, k, v)))
      runs[impl] = lambda fn=fn, args=args: jax.block_until_ready(fn(*args))
    tq, tk, tv = (torch.tensor(x).transpose(1, 2).contiguous().requires_grad_()
                  for x in (q, np.repeat(k, heads // K, 2), np.repeat(v, heads // K, 2)))
    tdout = torch.tensor(dout).transpose(1, 2)
    mask = None
    if seg is not None:
      s = torch.tensor(seg)
      mask = (torch.ones(seq, seq, dtype=torch.bool).tril() & (s[:, :, None] == s[:, None, :]))
      mask = mask[:, None]

    def torch_run():
      out = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, is_causal=mask is None)
      out.backward(tdout)

    runs["torch"] = torch_run
    times = {name: [] for name in runs}
    for name, fn in runs.items():
      fn()
    for _ in range(repeats):
      for name, fn in runs.items():
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
    rows.append({"case": case, **{name: 1e3 * float(np.median(t)) for name, t in times.items()}})
  return rows


def attention_table(rows: list[dict], shape: str) -> str:
  names = [k for k in rows[0] if k != "case"]
  lines = [f"| {shape} | " + " | ".join(f"{n} ms" for n in names) + " |",
           "|---|" + "---:|" * len(names)]
  for r in rows:
    lines.append(f"| {r['case']} | " + " | ".join(f"{r[n]:.2f}" for n in names) + " |")
  return "\n".join(lines)
