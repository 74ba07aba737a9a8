"""What a config costs, before training it: the lesson's accounting as a tool.

The parameter count per layer and in total (as in "Counting parameters in a
decoder layer"), the KV cache per token and per sequence ("Cost: O(n^2)
attention and the KV cache"), FLOPs per token, the run's steps, tokens and
FLOPs (train.token_budget or train.flop_budget set the steps, as in train.py)
and a training-memory estimate; formulas in `model/accounting.py`.

  python -m model.summary --config configs/llama2_7b.py
  python -m model.summary --config configs/llama2_7b.py --config.model.num_kv_heads=8 --json
  python -m model.summary --config configs/gpt2_small.py --backend=cpu
  python -m model.summary --config configs/tiny.py --config.train.flop_budget=4.6e12

`--backend` (gpu, the default; tpu; cpu) is the device the training-memory
estimate is for, since it decides what `attention_impl=auto` runs.

A bad config prints `error: <message>` on one line and exits 2.
"""
import collections
import json
import sys

from absl import app, flags
from ml_collections import config_flags

from configs.cli import parse_flags
from configs.errors import UserError
from configs import validation
from model import accounting
from model.attention_kinds import ATTENTIONS
from model.config import ModelConfig
from model.resolve import resolve

_CONFIG = config_flags.DEFINE_config_file("config", lock_config=True)
_JSON = flags.DEFINE_bool("json", False, "Print one JSON object instead of the table.")
_BACKEND = flags.DEFINE_enum(
    "backend", "gpu", ["gpu", "tpu", "cpu"],
    "The device the training-memory estimate is for: it decides what "
    "model.attention_impl=auto runs (cudnn keeps no attention scores, xla does).")


def summarize(config, backend: str = "gpu") -> dict:
  """Every number of the summary, a JSON-ready dict (bytes, FLOPs, counts);
  the training memory as on `backend`."""
  m, depth = ModelConfig.resolve(config.model), config.train.mtp_depth
  report = accounting.measured_params(m, depth)
  per_token = accounting.kv_cache_bytes_per_token(m)
  state = accounting.linear_state_bytes(m)
  report.update(
      kv_cache_bytes_per_token=per_token,
      kv_cache_bytes_at_max_len=per_token * m.max_len + state,
      linear_state_bytes_per_sequence=state,
      flops_per_token_forward=accounting.flops_per_token(m, config.train.seq_len, train=False,
                                                         mtp_depth=depth),
      flops_per_token_train=accounting.flops_per_token(m, config.train.seq_len, train=True,
                                                       mtp_depth=depth),
      training_memory_bytes=accounting.training_memory_bytes(config, backend),
      train_steps=config.train.num_steps,
      train_tokens=config.train.num_steps * accounting.tokens_per_step(config.train),
      train_flops=config.train.num_steps * accounting.flops_per_step(config))
  if m.family == "decoder" and len(set(m.layer_types[:m.num_layers])) > 1:
    report["layer_kinds"] = accounting.layer_kind_costs(m, config.train.seq_len)
  if config.mesh.context > 1:
    report["context_attention_flops"] = accounting.context_attention_flops(
        m, config.train.seq_len, config.mesh.context)
  return report


def _count(n: int) -> str:
  return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _bytes(n: int) -> str:
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if n >= size:
      return f"{n / size:,.1f} {unit}"
  return f"{n} B"


def _rows(title: str, rows: list[tuple[str, int, str]]) -> list[str]:
  lines = [title]
  for label, value, note in rows:
    lines.append(f"  {label:<34}{value:>20,}  {note}".rstrip())
  return lines


def _layer_rows(name: str, num: int, layer: dict[str, int]) -> list[tuple[str, int, str]]:
  rows = [(f"{name}: {component}", count, "") for component, count in layer.items()]
  rows.append((f"{num} {name}s", num * layer["total"], ""))
  return rows


def _kind_rows(kinds: dict[str, dict[str, int]]) -> list[tuple[str, int, str]]:
  """A hybrid's rows per layer kind (`accounting.layer_kind_costs`): the
  parameters, FLOPs per token and cache of one layer of each kind."""
  rows = []
  for name, kind in kinds.items():
    active = ("" if kind["params_active"] == kind["params"]
              else f"{_count(kind['params_active'])} active")
    rows += [(f"{name} (x{kind['layers']}): parameters", kind["params"], active),
             (f"{name}: FLOPs per token", kind["flops_per_token_forward"], "")]
    if kind["state_bytes_per_sequence"]:
      rows.append((f"{name}: state per sequence", kind["state_bytes_per_sequence"],
                   f"bytes = {_bytes(kind['state_bytes_per_sequence'])}, any length"))
    else:
      rows.append((f"{name}: KV cache per token", kind["kv_cache_bytes_per_token"],
                   f"bytes = {_bytes(kind['kv_cache_bytes_per_token'])}"))
  return rows


def format_table(config, report: dict) -> str:
  """The summary as a readable table."""
  m, t = ModelConfig.resolve(config.model), config.train
  head = "tied head" if m.tie_embeddings else "untied head"
  mlp = f"{m.mlp} d_ff={m.d_ff}"
  if m.num_experts:
    where = "every layer" if len(m.moe_layers) == m.num_layers else f"layers {m.moe_layers}"
    shared = f" + {m.num_shared_experts} shared" if m.num_shared_experts else ""
    mlp = (f"{m.mlp} experts: {m.num_experts}{shared} of d_ff={m.moe_d_ff}, top "
           f"{m.experts_per_token} ({m.moe_router}) in {where}")
  lines = [f"{m.family}: d={m.d_model}, {ATTENTIONS[m.attention].describe(m)}, "
           f"{mlp}, {m.norm} {m.norm_position}-norm, "
           f"pos_emb={m.pos_emb}, V={m.vocab_size}, {head}", ""]
  params = []
  if "params_per_encoder_layer" in report:
    params += _layer_rows("encoder layer", report["num_encoder_layers"],
                          report["params_per_encoder_layer"])
  name = "decoder layer" if m.family == "encoder_decoder" else "layer"
  params += _layer_rows(name, report["num_layers"], report["params_per_layer"])
  total = report["params_total"]
  kinds = collections.Counter(m.layer_types[:m.num_layers])
  if len(kinds) > 1:  # the layers differ: count them all
    described = ", ".join(f"{count} {kind}" for kind, count in kinds.items())
    params[-1] = (f"{m.num_layers} layers ({described}; above: layer 0)",
                  total - report["params_embedding"] - report["params_final_norms"]
                  - report.get("params_mtp", 0), "")
  params += [("embedding + head + positions", report["params_embedding"], ""),
             ("final norms", report["params_final_norms"], ""),
             *([(f"{t.mtp_depth} MTP modules", report["params_mtp"], "train.mtp_depth")]
               if "params_mtp" in report else []),
             ("total", total, _count(total))]
  if report["params_active"] != total:
    active = report["params_active"]
    params.append(("active per token", active, f"{_count(active)}: k of the E experts"))
  lines += _rows("Parameters", params) + [""]
  kv = [("per token", report["kv_cache_bytes_per_token"],
         f"bytes = {_bytes(report['kv_cache_bytes_per_token'])}"),
        *([("linear layers' state per sequence", report["linear_state_bytes_per_sequence"],
            f"bytes = {_bytes(report['linear_state_bytes_per_sequence'])}, any length")]
          if report["linear_state_bytes_per_sequence"] else []),
        (f"per sequence at max_len {m.max_len}", report["kv_cache_bytes_at_max_len"],
         f"bytes = {_bytes(report['kv_cache_bytes_at_max_len'])}")]
  lines += _rows(f"KV cache ({config.model.dtype})", kv) + [""]
  n = "2N" if report["params_active"] == total else "2N (N active)"
  attention = ("4 L S d_attn" if m.v_head_dim == m.head_dim
               else "2 L S h (d_qk + d_v)")  # MLA: values narrower than queries and keys
  mtp = f" + the {t.mtp_depth} MTP modules' blocks and head" if t.mtp_depth else ""
  flops = [("forward", report["flops_per_token_forward"], f"{n} + {attention}{mtp}"),
           ("train", report["flops_per_token_train"], "3 x forward")]
  lines += _rows(f"FLOPs per token (PaLM, S = train.seq_len = {t.seq_len})", flops) + [""]
  if "layer_kinds" in report:
    lines += _rows("Per layer kind (one layer of each; FLOPs forward, per token)",
                   _kind_rows(report["layer_kinds"])) + [""]
  budget = validation.budget(t)
  steps_from = f"{budget[0]}={budget[1]:g}" if budget else "train.num_steps"
  run = [("steps", report["train_steps"], steps_from),
         ("tokens", report["train_tokens"], f"batch {t.batch_size} x {t.seq_len} per step"),
         ("FLOPs", report["train_flops"], f"{report['train_flops']:.3g}")]
  lines += _rows("Training run", run) + [""]
  if "context_attention_flops" in report:
    per_device = report["context_attention_flops"]
    zigzag, contiguous = per_device["zigzag"], per_device["contiguous"]
    rows = [("zig-zag (the model's), each", max(zigzag),
             f"{max(zigzag):.3g}; max/mean {max(zigzag) * len(zigzag) / sum(zigzag):.3f}"),
            ("contiguous, the busiest", max(contiguous),
             f"{max(contiguous):.3g}; max/mean "
             f"{max(contiguous) * len(contiguous) / sum(contiguous):.3f}")]
    lines += _rows(f"Attention FLOPs per device, one row, train step (mesh.context = "
                   f"{config.mesh.context}, causal)", rows) + [""]
  memory = [(part, size, _bytes(size)) for part, size in report["training_memory_bytes"].items()]
  lines += _rows(f"Training memory, bytes ({t.optimizer}, batch {t.batch_size} x {t.seq_len}, "
                 f"grad_accum {t.grad_accum_steps}, remat={validation.remat_name(t.remat)})", memory)
  return "\n".join(lines)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  config = _CONFIG.value
  try:
    config = resolve(config)
    report = summarize(config, _BACKEND.value)
  except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  print(json.dumps(report, indent=2) if _JSON.value else format_table(config, report))


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
