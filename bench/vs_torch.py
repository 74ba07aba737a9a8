"""Our training step and generation against a minimal PyTorch reference, on the CPU.

  python -m bench.vs_torch                       # both models, 600 steps, GPT-2 small decode
  python -m bench.vs_torch --steps 10 --decode_tokens 8 --gpt2 tiny   # a quick smoke run

Training. Each model of `--models` is trained in this one process twice:
with our step (`training.steps.jit_train_step`, as train.py runs it) and
with `TorchDecoder`, a plain PyTorch module trained by an idiomatic loop
(`TorchTrainer`: float32 cross-entropy, `clip_grad_norm_`,
`torch.optim.AdamW` with our betas, eps, weight decay and decay mask, a
`LambdaLR` equal to our schedule; `torch.compile` only with
`--torch_compile`). The models:

- `gpt2_style`: `--config` (configs/tiny.py) with LayerNorm, a tanh-GELU MLP
  of 4 d, learned positions and data.packing=concat (tied embeddings, no
  biases, as tiny.py);
- `tiny`: `--config` itself (RoPE, RMSNorm, SwiGLU; packed rows, so the
  torch side masks attention by segment and rotates by per-document
  positions, as ours does).

Both sides read the same batches: the first `--steps` batches of our data
pipeline (data.source through the tokenizer, tokenizer.path or one trained
on the train split), held in memory, so no data loading is timed. The torch
model starts from a copy of our initial parameters; the first step of each
side (ours compiles) is its start-up, and the two first-step losses must
agree to 1e-4 before anything is timed. The remaining steps run in
alternating blocks of `--block` steps (ours, then torch, on the same
batches), so that a busy machine slows both alike. Each step is timed from
the host batch to the updated parameters (`jax.block_until_ready`; torch
on the CPU is synchronous, `loss.item()`). Reported per side: median, p10
and p90 step time, tokens/s (batch x seq_len / median), the final training
loss, start-up (build, and the first step), and the ratio of tokens/s
ours / torch (above 1: ours is faster).

Decoding. A random `transformers` GPT-2 (`--gpt2 small`: GPT2Config's
defaults, 124M parameters; `tiny`: 2 layers of width 64), seeded, is saved
with our tokenizer and imported with `hf.convert.from_hf`; then prompts of
`--prompt_len` random ids decode `--decode_tokens` new tokens greedily at
each batch size of `--decode_batches`, with `model.generate.generate` and
with transformers' `generate` (do_sample=False, use_cache=True, no EOS).
The tokens must be identical. Each is called once (compilation, warm-up),
then `--repeats` times, alternating; tokens/s = batch x new tokens / median
seconds of a call (the prompt's prefill included).

Host memory: as train.py does, the process first tells glibc's malloc to
keep freed memory for reuse (`training.host_memory`; it applies to both
sides, one process); setting any MALLOC_* variable, say MALLOC_ARENA_MAX=8,
leaves glibc's defaults, and the JSON says which ran (`reuse_host_memory`).

Prints a table and writes bench/results/vs_torch-<date>.json (or `--out`).
torch and transformers are imported by this script only (test
requirements), never by the library.
"""
from training.host_memory import reuse_freed_memory  # standard library only

# As train.py does, run as a script, and first: before torch and JAX start threads.
HOST_MEMORY_REUSED = __name__ == "__main__" and reuse_freed_memory()

import datetime  # pylint: disable=wrong-import-position,wrong-import-order
import json
import math
import os
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np
import torch
import torch.nn.functional as F
import transformers
from absl import app, flags, logging
from flax import nnx
from ml_collections import config_flags
from torch import nn

from bench import cpu_profile
from bench.bench_utils import command_line, git_commit
from configs import base
from configs.cli import parse_flags
from configs.errors import UserError
from data import pipeline
from hf import convert as hf_convert
from model import build_model
from model.config import ModelConfig
from model.embeddings import rope_frequencies
from model.generate import generate
from model.resolve import resolve
from tokenizer import export_hf, load_tokenizer, train_tokenizer
from training.hardware import cpu_model
from training.optim import learning_rate_schedule, model_optimizer
from training.steps import init_state, jit_train_step
from training.workdir import load_run

ROOT = pathlib.Path(__file__).resolve().parents[1]
FLAGS = flags.FLAGS

MODELS = ("gpt2_style", "tiny")
PARTS = ("train", "decode", "profile", "attention")
FIRST_LOSS_TOLERANCE = 1e-4

# The model fields TorchDecoder reads, and the values it implements; every
# other model field must keep configs/base.py's default.
TORCH_CHOICES = {"family": ("decoder",), "pos_emb": ("rope", "learned"),
                 "norm": ("rmsnorm", "layernorm"), "mlp": ("swiglu", "gelu", "gelu_tanh"),
                 "dtype": ("float32",), "param_dtype": ("float32",)}
TORCH_READS = ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff", "max_len",
               "rope_theta", "norm_eps", "init_std")
# Fields that change how ours runs but not the function it computes.
NOT_FORWARD = ("attention_impl", "pallas_lowering", "scan_layers", "scan_unroll")
# The training the torch loop implements (lr_factor: warm-up then cosine).
TORCH_TRAIN = {"objective": "next_token", "optimizer": "adamw", "schedule": "cosine",
               "z_loss": 0.0}


def _define_flags() -> None:
  """The command's flags, defined when it runs (importing this module, as the
  tests do, defines none)."""
  config_flags.DEFINE_config_file("config", str(ROOT / "configs" / "tiny.py"),
                                  "The tiny model's config (gpt2_style is derived from it).",
                                  lock_config=True)
  flags.DEFINE_list("models", list(MODELS), f"Models to train, of {', '.join(MODELS)}.")
  flags.DEFINE_list("parts", ["train", "decode"], "What to run: train, decode, profile "
                    "(each side's step time by op category), attention (attention alone, "
                    "forward + backward).")
  flags.DEFINE_integer("profile_steps", 10, "Steps profiled per side and model (after as "
                       "many warm-up steps).")
  flags.DEFINE_integer("steps", None, "Training steps per side and model (the first is the "
                       "start-up); default train.num_steps, the whole schedule.")
  flags.DEFINE_integer("block", 20, "Steps per side before the other side takes its turn.")
  flags.DEFINE_boolean("torch_compile", False, "torch.compile the torch model.")
  flags.DEFINE_enum("gpt2", "small", ["small", "tiny"], "The GPT-2 decoded: small (124M, "
                    "GPT2Config's defaults) or tiny (2 layers, width 64).")
  flags.DEFINE_integer("prompt_len", 32, "Prompt tokens per row.")
  flags.DEFINE_integer("decode_tokens", 128, "New tokens per row.")
  flags.DEFINE_list("decode_batches", ["1", "8"], "Batch sizes decoded.")
  flags.DEFINE_integer("repeats", 3, "Timed calls per decoder and batch (the median counts).")
  flags.DEFINE_string("out", None, "JSON output; default bench/results/vs_torch-<date>.json.")


# The models' configs.

def model_config(config, name: str):
  """`config` for model `name` (`MODELS`): gpt2_style with LayerNorm, tanh
  GELU of 4 d, learned positions and concat packing; tiny as it is."""
  c = config.copy_and_resolve_references()
  if name == "gpt2_style":
    c.model.update(norm="layernorm", mlp="gelu_tanh", pos_emb="learned",
                   d_ff=4 * c.model.d_model, use_bias=False, tie_embeddings=True)
    c.data.packing = "concat"
  c = resolve(c)
  check_torch_support(c.model, c.train, name)
  return c


def check_torch_support(model_section, train_section, name: str) -> None:
  """UserError naming the first model or train field the torch side does not implement."""
  for field, value in TORCH_TRAIN.items():
    if train_section[field] != value:
      raise UserError(f"{name}: train.{field}={train_section[field]!r}: the torch loop "
                      f"implements only {value!r}")
  defaults = base.get_config().model
  for field, value in model_section.items():
    if field in TORCH_CHOICES:
      if value not in TORCH_CHOICES[field]:
        raise UserError(f"{name}: model.{field}={value!r}: the torch reference implements "
                        f"{', '.join(TORCH_CHOICES[field])}")
    elif field not in TORCH_READS + NOT_FORWARD and value != defaults[field]:
      raise UserError(f"{name}: model.{field}={value!r}: the torch reference implements only "
                      f"the default {defaults[field]!r}")


def lr_factor(train_cfg, step: int) -> float:
  """Our schedule (`training.optim.learning_rate_schedule`, warm-up then
  cosine) over the peak, written out: the LambdaLR factor of step `step`."""
  t = train_cfg
  if step < t.warmup_steps:
    return step / t.warmup_steps
  decay_steps = max(t.num_steps, t.warmup_steps + 1) - t.warmup_steps
  progress = min(step - t.warmup_steps, decay_steps) / decay_steps
  return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def check_schedule(train_cfg, steps: int) -> None:
  """The torch schedule equals ours at every step run."""
  ours = np.asarray(jax.vmap(learning_rate_schedule(train_cfg))(np.arange(steps)))
  theirs = np.array([train_cfg.learning_rate * lr_factor(train_cfg, s) for s in range(steps)])
  np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-9)


# The torch reference.

def torch_norm(cfg) -> nn.Module:
  """nn.RMSNorm or nn.LayerNorm (with its bias) of width d_model, our epsilon."""
  if cfg.norm == "rmsnorm":
    return nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
  return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)


class TorchBlock(nn.Module):
  """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg):
    super().__init__()
    d, hd = cfg.d_model, cfg.num_heads * cfg.head_dim
    self.heads, self.head_dim = cfg.num_heads, cfg.head_dim
    self.norm_attn, self.norm_mlp = torch_norm(cfg), torch_norm(cfg)
    self.q, self.k, self.v = (nn.Linear(d, hd, bias=False) for _ in range(3))
    self.o = nn.Linear(hd, d, bias=False)
    self.up = nn.Linear(d, cfg.d_ff, bias=False)
    self.gate = nn.Linear(d, cfg.d_ff, bias=False) if cfg.mlp == "swiglu" else None
    self.down = nn.Linear(cfg.d_ff, d, bias=False)
    self.gelu = "tanh" if cfg.mlp == "gelu_tanh" else "none"

  def attention(self, x, rope, mask):
    B, T, _ = x.shape
    q, k, v = (proj(x).view(B, T, self.heads, self.head_dim) for proj in (self.q, self.k, self.v))
    if rope is not None:
      q, k = rotate(q, *rope), rotate(k, *rope)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
    return self.o(out.transpose(1, 2).reshape(B, T, -1))

  def mlp(self, x):
    if self.gate is not None:
      return self.down(F.silu(self.gate(x)) * self.up(x))
    return self.down(F.gelu(self.up(x), approximate=self.gelu))

  def forward(self, x, rope, mask):
    x = x + self.attention(self.norm_attn(x), rope, mask)
    return x + self.mlp(self.norm_mlp(x))


def rotate(x, cos, sin):
  """RoPE as model/embeddings.py's `apply_rope`: pairs (x[i], x[i + D/2])
  rotated; x [B, T, H, D], cos and sin [B, T, 1, D/2]."""
  x1, x2 = x.chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class TorchDecoder(nn.Module):
  """The decoder of our ModelConfig `cfg` in plain PyTorch: tied embeddings,
  learned positions or RoPE, pre-norm blocks, final norm; weights drawn from
  N(0, init_std), norms ones (and zeros), as ours."""

  def __init__(self, cfg):
    super().__init__()
    self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
    self.pos = nn.Embedding(cfg.max_len, cfg.d_model) if cfg.pos_emb == "learned" else None
    self.blocks = nn.ModuleList(TorchBlock(cfg) for _ in range(cfg.num_layers))
    self.final_norm = torch_norm(cfg)
    inv_freq = rope_frequencies(cfg.head_dim, cfg.rope_theta)[0]
    self.register_buffer("inv_freq", torch.tensor(inv_freq, dtype=torch.float32),
                         persistent=False)
    for module in self.modules():
      if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=cfg.init_std)

  def forward(self, tokens, positions, segment_ids=None):
    """Float32 logits [B, T, V]; with `segment_ids` a query sees the earlier
    keys of its own segment only (a padding query, segment 0, sees earlier
    padding: no NaN, and no loss reads it)."""
    x = self.embed(tokens)
    if self.pos is not None:
      x = x + self.pos(positions)
    rope = None
    if self.pos is None:
      angles = positions[..., None].float() * self.inv_freq
      rope = (angles.cos()[:, :, None], angles.sin()[:, :, None])
    mask = None
    if segment_ids is not None:
      T = tokens.shape[1]
      causal = torch.ones(T, T, dtype=torch.bool).tril()
      mask = (causal & (segment_ids[:, :, None] == segment_ids[:, None, :]))[:, None]
    for block in self.blocks:
      x = block(x, rope, mask)
    return F.linear(self.final_norm(x), self.embed.weight)


def ours_by_name(params) -> dict:
  """Our parameters as {"decoder/layers/attn/q_proj/kernel": array}."""
  return {jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value"):
          np.array(x) for path, x in jax.tree_util.tree_leaves_with_path(params)}


def copy_into_torch(torch_model: TorchDecoder, params, cfg) -> None:
  """Sets every weight of `torch_model` to ours (`params`), transposed to
  nn.Linear's [out, in]; each of ours is used exactly once."""
  ours = ours_by_name(params)
  used = set()

  def take(name, layer=None):
    """Our parameter `name`; with `layer`, block `layer`'s, from a loop of
    blocks (decoder/layers/<i>/...) or a scanned stack (slice i)."""
    if layer is None:
      used.add(name)
      return ours[name]
    looped, stacked = f"decoder/layers/{layer}/{name}", f"decoder/layers/{name}"
    if looped in ours:
      used.add(looped)
      return ours[looped]
    used.add(stacked)
    return ours[stacked][layer]

  def norm(module, name, layer=None):
    pairs = [(module.weight, take(f"{name}/scale", layer))]
    if getattr(module, "bias", None) is not None:
      pairs.append((module.bias, take(f"{name}/bias", layer)))
    return pairs

  d = cfg.d_model
  pairs = [(torch_model.embed.weight, take("decoder/embed/embedding"))]
  if torch_model.pos is not None:
    pairs.append((torch_model.pos.weight, take("decoder/positions/table")))
  pairs += norm(torch_model.final_norm, "decoder/final_norm")
  for i, block in enumerate(torch_model.blocks):
    pairs += norm(block.norm_attn, "norm_attn", i) + norm(block.norm_mlp, "norm_mlp", i)
    for proj, name in ((block.q, "q_proj"), (block.k, "k_proj"), (block.v, "v_proj")):
      pairs.append((proj.weight, take(f"attn/{name}/kernel", i).reshape(d, -1).T))
    pairs.append((block.o.weight, take("attn/o_proj/kernel", i).reshape(-1, d).T))
    pairs += [(block.up.weight, take("mlp/up/kernel", i).T),
              (block.down.weight, take("mlp/down/kernel", i).T)]
    if block.gate is not None:
      pairs.append((block.gate.weight, take("mlp/gate/kernel", i).T))
  if used != set(ours) or len(pairs) != len(list(torch_model.parameters())):
    raise AssertionError(f"parameters not mapped: ours {sorted(set(ours) - used)}")
  with torch.no_grad():
    for target, value in pairs:
      target.copy_(torch.from_numpy(np.ascontiguousarray(value)))


class Side:
  """One side of the comparison: `step(batch) -> loss` runs one training
  step to completion; `times` and `losses` collect them."""

  def __init__(self):
    self.times: list[float] = []
    self.losses: list[float] = []
    self.build_s = self.first_step_s = None

  def timed(self, batch) -> None:
    """One step on `batch`, its loss kept; its time is the start-up's first
    step the first time, else one of `times`."""
    start = time.perf_counter()
    loss = self.step(batch)
    seconds = time.perf_counter() - start
    if self.first_step_s is None:
      self.first_step_s = seconds
    else:
      self.times.append(seconds)
    self.losses.append(loss)

  def step(self, batch) -> float:
    raise NotImplementedError


class OursTrainer(Side):
  """train.py's step: `jit_train_step` over `init_state`, donated."""

  def __init__(self, config):
    super().__init__()
    start = time.perf_counter()
    tc = config.train
    model = build_model(config.model, nnx.Rngs(tc.seed), remat=tc.remat)
    graphdef, params = nnx.split(model)
    tx = model_optimizer(config)
    self.state = init_state(params, tx, tc.seed)
    self.step_fn = jit_train_step(graphdef, tx, learning_rate_schedule(tc), tc.objective,
                                  tc.grad_accum_steps)
    jax.block_until_ready(self.state)
    self.build_s = time.perf_counter() - start

  def step(self, batch) -> float:
    self.state, metrics = self.step_fn(self.state, batch)
    jax.block_until_ready((self.state, metrics))
    return float(metrics["loss"])


class TorchTrainer(Side):
  """A minimal PyTorch loop over `TorchDecoder`, started from our initial
  parameters `params`."""

  def __init__(self, config, params, compile_model: bool):
    super().__init__()
    tc, cfg = config.train, ModelConfig.resolve(config.model)
    torch.manual_seed(tc.seed)
    start = time.perf_counter()
    model = TorchDecoder(cfg)
    self.build_s = time.perf_counter() - start
    copy_into_torch(model, params, cfg)  # not timed: only for the comparison
    start = time.perf_counter()
    # Our decay mask: matrices and embeddings decay, norms (vectors) do not.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    self.optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.learning_rate, betas=(tc.b1, tc.b2), eps=1e-8)
    self.scheduler = torch.optim.lr_scheduler.LambdaLR(
        self.optimizer, lambda step: lr_factor(tc, step))
    self.model = torch.compile(model) if compile_model else model
    self.grad_clip = tc.grad_clip
    self.build_s += time.perf_counter() - start

  def step(self, batch) -> float:
    tokens = torch.from_numpy(batch["inputs"])
    targets = torch.from_numpy(batch["targets"]).long()
    mask = torch.from_numpy(batch["loss_mask"])
    segment_ids = batch.get("segment_ids")
    logits = self.model(tokens, torch.from_numpy(batch["positions"]),
                        None if segment_ids is None else torch.from_numpy(segment_ids))
    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none")
    loss = (losses * mask.flatten()).sum() / mask.sum().clamp(min=1.0)
    loss.backward()
    with torch.profiler.record_function("optimizer"):  # a category of bench.cpu_profile
      if self.grad_clip > 0:
        nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip)
      self.optimizer.step()
      self.scheduler.step()
      self.optimizer.zero_grad(set_to_none=True)
    return loss.item()


def get_tokenizer(config):
  """tokenizer.path's tokenizer, or one trained on the train split as train.py would."""
  if config.tokenizer.path:
    return load_tokenizer(config.tokenizer.path)
  print(f"training a {config.tokenizer.vocab_size}-id {config.tokenizer.kind} tokenizer on "
        f"data.source={config.data.source} (set --config.tokenizer.path to reuse one)",
        flush=True)
  return train_tokenizer(config.tokenizer.kind, config.tokenizer.vocab_size,
                         pipeline.tokenizer_texts(config.data, config.tokenizer.train_bytes))


def take_batches(config, tokenizer, steps: int) -> list[dict]:
  """The first `steps` training batches of our pipeline, as numpy arrays."""
  data = pipeline.make_train_iterator(config, tokenizer)
  return [{k: np.asarray(v) for k, v in next(data).items()} for _ in range(steps)]


def side_report(side: Side, tokens_per_step: int) -> dict:
  """A side's step-time percentiles, tokens/s, losses and start-up."""
  median = statistics.median(side.times)
  p10, p90 = np.percentile(side.times, [10, 90])
  return {"ms_median": 1e3 * median, "ms_p10": 1e3 * float(p10), "ms_p90": 1e3 * float(p90),
          "tokens_per_s": tokens_per_step / median,
          "first_step_loss": side.losses[0], "final_loss": side.losses[-1],
          "build_s": side.build_s, "first_step_s": side.first_step_s,
          "startup_s": side.build_s + side.first_step_s,
          "ms_all": [1e3 * t for t in side.times], "losses": side.losses}


def train_model(config, name: str, tokenizer, *, steps: int, block: int,
                torch_compile: bool) -> dict:
  """Trains model `name` with ours and with torch, alternating; its report."""
  c = model_config(config, name)
  tc = c.train
  check_schedule(tc, steps)
  batches = take_batches(c, tokenizer, steps)
  ours = OursTrainer(c)
  theirs = TorchTrainer(c, ours.state["params"], torch_compile)
  ours.timed(batches[0])
  theirs.timed(batches[0])
  gap = abs(ours.losses[0] - theirs.losses[0])
  if gap > FIRST_LOSS_TOLERANCE:
    raise AssertionError(f"{name}: first-step losses differ by {gap:.2e} (ours "
                         f"{ours.losses[0]:.6f}, torch {theirs.losses[0]:.6f}): not the same "
                         "function")
  for first in range(1, steps, block):
    for side in (ours, theirs):
      for batch in batches[first:first + block]:
        side.timed(batch)
  tokens_per_step = tc.batch_size * tc.seq_len
  report = {"model": name, "pos_emb": c.model.pos_emb, "norm": c.model.norm,
            "mlp": c.model.mlp, "d_ff": c.model.d_ff, "packing": c.data.packing,
            "params": sum(x.size for x in jax.tree.leaves(ours.state["params"])),
            "tokens_per_step": tokens_per_step, "first_step_loss_gap": gap,
            "loss_gap_max": max(abs(a - b) for a, b in zip(ours.losses, theirs.losses)),
            "ours": side_report(ours, tokens_per_step),
            "torch": side_report(theirs, tokens_per_step)}
  report["ratio_ours_over_torch"] = (report["ours"]["tokens_per_s"] /
                                     report["torch"]["tokens_per_s"])
  return report


def profile_model(config, name: str, tokenizer, steps: int) -> dict:
  """Model `name`'s step time by op category (`bench.cpu_profile`), ours and
  torch's, over `steps` steps after as many warm-up steps (whose median
  time, without a profiler, is each side's `step_ms`; the first, compiling
  step, is left out)."""
  c = model_config(config, name)
  batches = take_batches(c, tokenizer, 2 * steps)
  ours = OursTrainer(c)
  theirs = TorchTrainer(c, ours.state["params"], compile_model=False)
  hlo = ours.step_fn.lower(ours.state, batches[0]).compile().as_text()
  for side in (ours, theirs):
    for batch in batches[:steps]:
      side.timed(batch)
  report = {"model": name, "steps": steps,
            "ours": cpu_profile.profile_ours(ours.step, batches[steps:], hlo),
            "torch": cpu_profile.profile_torch(theirs.step, batches[steps:])}
  for side, key in ((ours, "ours"), (theirs, "torch")):
    report[key]["step_ms"] = 1e3 * statistics.median(side.times)
  return report


# Decoding.

def random_gpt2(size: str):
  """A seeded random transformers GPT-2: GPT2Config's defaults, or a tiny one."""
  torch.manual_seed(0)
  hf_config = transformers.GPT2Config() if size == "small" else transformers.GPT2Config(
      vocab_size=1024, n_positions=256, n_embd=64, n_layer=2, n_head=4)
  return transformers.GPT2LMHeadModel(hf_config).eval()


def decode(tokenizer, *, size: str, prompt_len: int, new_tokens: int, batches: list[int],
           repeats: int) -> dict:
  """Greedy decoding of the imported GPT-2 by ours and by transformers; its report."""
  hf_model = random_gpt2(size)
  with tempfile.TemporaryDirectory() as tmp:
    hf_dir = pathlib.Path(tmp) / "hf"
    hf_model.save_pretrained(hf_dir)
    export_hf(tokenizer, hf_dir)
    hf_convert.from_hf(str(hf_dir), str(pathlib.Path(tmp) / "run"))
    config, _, model, _ = load_run(str(pathlib.Path(tmp) / "run"))
  rng = np.random.default_rng(0)
  rows = []
  for batch in batches:
    prompts = rng.integers(0, hf_model.config.vocab_size, (batch, prompt_len)).tolist()

    def ours():
      return generate(model, config.model, prompts, max_new_tokens=new_tokens, eos_id=-1)

    def theirs():
      ids = torch.as_tensor(prompts)
      out = hf_model.generate(ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=new_tokens, do_sample=False, use_cache=True,
                              eos_token_id=None, pad_token_id=0)
      return out[:, prompt_len:].tolist()

    first = {}
    for name, fn in (("ours", ours), ("transformers", theirs)):
      start = time.perf_counter()
      first[name] = (fn(), time.perf_counter() - start)
    if first["ours"][0] != first["transformers"][0]:
      row, col = next((r, c) for r, (a, b) in enumerate(zip(*(first[n][0] for n in first)))
                      for c in range(new_tokens) if a[c] != b[c])
      raise AssertionError(f"batch {batch}: greedy tokens differ first at row {row}, new token "
                           f"{col}: ours {first['ours'][0][row][col]}, transformers "
                           f"{first['transformers'][0][row][col]}")
    times = {"ours": [], "transformers": []}
    for _ in range(repeats):
      for name, fn in (("ours", ours), ("transformers", theirs)):
        start = time.perf_counter()
        fn()
        times[name].append(time.perf_counter() - start)
    report = {"batch": batch, "identical_tokens": True}
    for name, seconds in times.items():
      median = statistics.median(seconds)
      report[name] = {"s_median": median, "tokens_per_s": batch * new_tokens / median,
                      "first_call_s": first[name][1], "s_all": seconds}
    report["ratio_ours_over_transformers"] = (report["ours"]["tokens_per_s"] /
                                              report["transformers"]["tokens_per_s"])
    rows.append(report)
  return {"gpt2": size, "params": sum(p.numel() for p in hf_model.parameters()),
          "prompt_len": prompt_len, "new_tokens": new_tokens, "repeats": repeats, "rows": rows}


# The report.

def train_table(reports: list[dict]) -> str:
  lines = ["| model | side | ms/step p50 (p10-p90) | tokens/s | final loss | start-up s "
           "(build + first step) | ours/torch |", "|---|---|---:|---:|---:|---:|---:|"]
  for r in reports:
    for side in ("ours", "torch"):
      s = r[side]
      ratio = f"{r['ratio_ours_over_torch']:.3f}" if side == "ours" else ""
      lines.append(f"| {r['model']} | {side} | {s['ms_median']:.1f} ({s['ms_p10']:.1f}-"
                   f"{s['ms_p90']:.1f}) | {s['tokens_per_s']:,.0f} | {s['final_loss']:.4f} | "
                   f"{s['startup_s']:.2f} ({s['build_s']:.2f} + {s['first_step_s']:.2f}) | "
                   f"{ratio} |")
  return "\n".join(lines)


def decode_table(report: dict) -> str:
  lines = ["| GPT-2 | batch | ours tokens/s | transformers tokens/s | ours/transformers |",
           "|---|---:|---:|---:|---:|"]
  for r in report["rows"]:
    lines.append(f"| {report['gpt2']} | {r['batch']} | {r['ours']['tokens_per_s']:,.1f} | "
                 f"{r['transformers']['tokens_per_s']:,.1f} | "
                 f"{r['ratio_ours_over_transformers']:.3f} |")
  return "\n".join(lines)


def check_flags() -> tuple[int, list[int]]:
  """(steps, decode batch sizes) from the flags; UserError for a bad one."""
  for flag, allowed in (("models", MODELS), ("parts", PARTS)):
    bad = [v for v in FLAGS[flag].value if v not in allowed]
    if bad or not FLAGS[flag].value:
      raise UserError(f"--{flag}={','.join(FLAGS[flag].value)}: choose from "
                      f"{', '.join(allowed)}")
  steps = FLAGS.config.train.num_steps if FLAGS.steps is None else FLAGS.steps
  if steps < 2 or FLAGS.block < 1 or FLAGS.repeats < 1 or FLAGS.profile_steps < 1:
    raise UserError("--steps must be at least 2 (the first is the start-up), --block, "
                    "--repeats and --profile_steps at least 1")
  if FLAGS.prompt_len < 1 or FLAGS.decode_tokens < 1:
    raise UserError("--prompt_len and --decode_tokens must be at least 1")
  try:
    batches = [int(b) for b in FLAGS.decode_batches]
  except ValueError:
    batches = []
  if not batches or min(batches) < 1:
    raise UserError(f"--decode_batches={','.join(FLAGS.decode_batches)}: positive integers")
  return steps, batches


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
  logging.set_verbosity(logging.WARNING)
  transformers.logging.set_verbosity_error()
  transformers.logging.disable_progress_bar()
  config = FLAGS.config
  try:
    steps, decode_batches = check_flags()
    for name in FLAGS.models:
      model_config(config, name)
    tokenizer = get_tokenizer(config)
  except (UserError, ValueError) as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  out = pathlib.Path(FLAGS.out or ROOT / "bench" / "results" /
                     f"vs_torch-{datetime.date.today()}.json")
  meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"),
          "command": command_line(), "commit": git_commit(),
          "device": jax.devices()[0].device_kind, "backend": jax.default_backend(),
          "cpu_model": cpu_model(), "cpus": os.cpu_count(),
          "torch_threads": torch.get_num_threads(), "reuse_host_memory": HOST_MEMORY_REUSED,
          "jax": jax.__version__, "torch": torch.__version__,
          "transformers": transformers.__version__, "torch_compile": FLAGS.torch_compile,
          "batch_size": config.train.batch_size, "seq_len": config.train.seq_len,
          "steps": steps, "block": FLAGS.block,
          "schedule": {"learning_rate": config.train.learning_rate,
                       "warmup_steps": config.train.warmup_steps,
                       "num_steps": config.train.num_steps, "schedule": config.train.schedule,
                       "min_lr_ratio": config.train.min_lr_ratio}}
  print(f"# ours vs torch on {meta['device']}, {meta['cpu_model']} ({meta['cpus']} CPUs, "
        f"torch threads {meta['torch_threads']}), jax {meta['jax']}, torch {meta['torch']}, commit "
        f"{meta['commit']}, {meta['date']}", flush=True)
  result = {**meta, "train": [], "decode": None}
  if "train" in FLAGS.parts:
    print(f"# training: batch {config.train.batch_size} x {config.train.seq_len}, {steps} steps "
          f"per side, blocks of {FLAGS.block}", flush=True)
    for name in FLAGS.models:
      report = train_model(config, name, tokenizer, steps=steps, block=FLAGS.block,
                           torch_compile=FLAGS.torch_compile)
      print(f"{name}: first-step loss ours {report['ours']['first_step_loss']:.6f}, torch "
            f"{report['torch']['first_step_loss']:.6f} (gap {report['first_step_loss_gap']:.1e}; "
            f"largest gap over the {steps} steps {report['loss_gap_max']:.1e})",
            flush=True)
      result["train"].append(report)
    result["train_table"] = train_table(result["train"])
    print()
    print(result["train_table"])
    print()
  if "decode" in FLAGS.parts:
    print(f"# decoding: GPT-2 {FLAGS.gpt2}, prompt {FLAGS.prompt_len}, {FLAGS.decode_tokens} new "
          f"tokens, greedy, median of {FLAGS.repeats} calls", flush=True)
    result["decode"] = decode(tokenizer, size=FLAGS.gpt2, prompt_len=FLAGS.prompt_len,
                              new_tokens=FLAGS.decode_tokens, batches=decode_batches,
                              repeats=FLAGS.repeats)
    result["decode_table"] = decode_table(result["decode"])
    print()
    print(result["decode_table"])
    print("tokens identical in every row")
  if "profile" in FLAGS.parts:
    print(f"# step time by op category, {FLAGS.profile_steps} profiled steps per side",
          flush=True)
    result["profile"] = [profile_model(config, name, tokenizer, FLAGS.profile_steps)
                         for name in FLAGS.models]
    result["profile_table"] = cpu_profile.profile_table(result["profile"])
    print()
    print(result["profile_table"])
    print()
  if "attention" in FLAGS.parts:
    cfg = ModelConfig.resolve(config.model)
    shape = dict(batch=config.train.batch_size, seq=config.train.seq_len, heads=cfg.num_heads,
                 head_dim=cfg.head_dim)
    label = "B {batch}, T {seq}, H {heads}, D {head_dim}, fwd+bwd".format(**shape)
    print(f"# attention alone: {label}, float32, median of {FLAGS.repeats} calls", flush=True)
    result["attention"] = {"shape": shape, "repeats": FLAGS.repeats,
                           "rows": cpu_profile.attention_times(**shape, repeats=FLAGS.repeats)}
    result["attention_table"] = cpu_profile.attention_table(result["attention"]["rows"], label)
    print()
    print(result["attention_table"])
    print()
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps(result, indent=1) + "\n")
  print(f"wrote {out}")


if __name__ == "__main__":
  _define_flags()
  app.run(main, flags_parser=parse_flags)
