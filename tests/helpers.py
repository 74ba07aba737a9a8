"""Helpers shared by several test modules (fixtures are in `conftest.py`).

Test modules import from here, never from each other. Nothing here imports
torch or transformers, so every module may import it whatever it needs.
"""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Regex, trainers

import convert
from aot.targets import LIBTPU_DIR
from configs import base
from data import corpora
from model.attention import attention
from model.kernels.router import flash_attention
from model.transformer import segment
from tokenizer import export_hf
from training.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.py")


def with_libtpu(env: dict) -> dict:
  """`env` for a subprocess that compiles for TPU: .venv/libtpu on its PYTHONPATH."""
  paths = [p for p in (env.get("PYTHONPATH"), str(LIBTPU_DIR)) if p]
  return dict(env, PYTHONPATH=os.pathsep.join(paths))


# Commands run as a user runs them.

def python_on_cpu_devices(args, count: int) -> subprocess.CompletedProcess:
  """`python args...` in the repository root, in a fresh process with `count`
  CPU devices (the host platform split by XLA_FLAGS, beside the suite's own
  flags), output captured."""
  env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
  flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={count}"
  env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=flags.strip(), PYTHONPATH=str(ROOT))
  return subprocess.run([sys.executable, *map(str, args)], env=env, cwd=ROOT,
                        capture_output=True, text=True, timeout=300, check=False)


def run_on_cpu_devices(script: str, count: int) -> subprocess.CompletedProcess:
  """`python -c script` on `count` CPU devices (`python_on_cpu_devices`)."""
  return python_on_cpu_devices(["-c", script], count)


def json_on_cpu_devices(script: str, count: int, *args) -> dict:
  """`python -c script args...` on `count` CPU devices; the JSON object its
  last line of output prints (the test fails with its stderr's tail if not)."""
  proc = python_on_cpu_devices(["-c", script, *args], count)
  assert proc.returncode == 0, proc.stderr[-4000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run_python(args) -> subprocess.CompletedProcess:
  """`python args...` in the repository root, output captured."""
  return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                        timeout=300)


def run_command(*args) -> None:
  """`python args...` in the repository root; its stderr's tail if it fails."""
  result = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True,
                          check=False, cwd=ROOT)
  assert result.returncode == 0, result.stderr[-2000:]


def assert_one_line_error(result, *fragments):
  """A failed command whose stderr has a line with every fragment, no traceback."""
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  lines = [l for l in result.stderr.strip().splitlines() if l.strip()]
  assert any(all(f in l for f in fragments) for l in lines), result.stderr


# Data.

PAD, BOS, EOS = 0, 1, 2


class ByteTokenizer:
  """Stand-in for the tokenizer contract: UTF-8 bytes + 4; ids 0..3 special."""
  vocab_size = 260
  pad_id, bos_id, eos_id, mask_id = PAD, BOS, EOS, 3

  def __init__(self, fingerprint: str = "bytes-v1"):
    self.fingerprint = fingerprint
    self.encode_calls = 0

  def encode(self, text: str) -> list[int]:
    return [b + 4 for b in text.encode("utf-8")]

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    self.encode_calls += 1
    return [self.encode(t) for t in texts]

  def decode(self, ids: list[int]) -> str:
    return bytes(i - 4 for i in ids if i >= 4).decode("utf-8", errors="replace")


def make_config(tmp_path, **data):
  """configs/base.py with small batches, a cache under `tmp_path`, `data` overrides."""
  config = base.get_config()
  config.data.cache_dir = str(tmp_path / "cache")
  config.data.tokenize_workers = 1  # in this process: tests count its encode calls
  config.train.batch_size = 4
  config.train.seq_len = 16
  for key, value in data.items():
    config.data[key] = value
  return config


def write_files(directory, texts: dict[str, str]) -> None:
  for name, text in texts.items():
    (directory / name).parent.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text, encoding="utf-8")


def both_splits(name_of, val_percent: int, at_least: int) -> int:
  """How many of the documents name_of(0), name_of(1), ... (at least
  `at_least`) a test writes so that both splits have one: documents are split
  by a hash of their name (`corpora.is_validation`), and a name holds the
  test's temporary directory, so a fixed count can leave a split empty."""
  count = at_least
  while len({corpora.is_validation(name_of(i), val_percent) for i in range(count)}) < 2:
    count += 1
  return count


def assert_batches_equal(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    assert x.keys() == y.keys()
    for key in x:
      np.testing.assert_array_equal(x[key], y[key], err_msg=key)


def take(iterator, n):
  return [next(iterator) for _ in range(n)]


# Models and training runs.

def small_cfg(**overrides):
  """A two-layer model section, reference attention."""
  c = base.get_config().model
  c.update(vocab_size=64, d_model=32, num_layers=2, num_heads=4, d_ff=64, max_len=32,
           attention_impl="reference")
  c.update(**overrides)
  return c


def small_config(tok_path: str, cache_dir: str = "/tmp/transformer_lab_test_cache"):
  """A whole config that trains in seconds with the tokenizer at `tok_path`."""
  c = base.get_config()
  c.model.update(vocab_size=320, d_model=32, num_layers=1, num_heads=2, d_ff=64, max_len=64,
                 attention_impl="xla")
  c.tokenizer.update(vocab_size=300, path=tok_path)
  c.data.update(source="pydoc", cache_dir=cache_dir)
  c.train.update(num_steps=30, batch_size=4, seq_len=32, learning_rate=3e-3, warmup_steps=5,
                 log_every=5, eval_every=15, eval_steps=2, checkpoint_every=5)
  return c


def overrides(c) -> list[str]:
  """The command-line flags that turn configs/base.py into `c`."""
  flat = []
  for section in ("model", "tokenizer", "data", "train"):
    for key, value in c[section].items():
      if value != base.get_config()[section][key]:
        flat.append(f"--config.{section}.{key}={value}")
  return flat


def train_cmd(c, workdir) -> list[str]:
  return [sys.executable, "train.py", "--config", "configs/base.py", "--workdir", str(workdir),
          *overrides(c)]


def final_params(workdir):
  """(step, params) of the newest checkpoint in `workdir`."""
  ck = Checkpointer(str(workdir), asynchronous=False)
  step = ck.latest_step()
  path = pathlib.Path(ck.directory) / str(step) / "state"
  ck.close()
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  restored = ocp.StandardCheckpointer().restore(path)
  return step, restored["params"]


def snapshot(directory) -> dict:
  """Path -> (size, mtime) of everything under `directory`."""
  return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
          for p in pathlib.Path(directory).rglob("*")}


def assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def scanned_copy(looped, scanned):
  """`scanned` (a model in the scanned layout, concrete or from nnx.eval_shape)
  holding `looped`'s weights: each layer's variables (parameters and the
  deepseek router's selection biases) stacked along the layer axis (of the
  stack, or of the segment "a_to_b" or "a_to_b_every_p" that holds it), the others as
  they are."""
  loop_params = dict(nnx.to_flat_state(nnx.state(looped)))
  graphdef, state = nnx.split(scanned)
  flat = []
  for path, variable in nnx.to_flat_state(state):
    if "layers" in path:
      at = path.index("layers") + 1
      seg = segment(str(path[at]))
      if seg is None:  # one run: the stack itself
        layer, rest = (lambda r: r), path[at:]
      elif seg.period == 1:
        layer, rest = seg.layer, path[at + 1:]
      else:  # block j of a cycle's body
        layer, rest = (lambda r, j=int(path[at + 1]), seg=seg: seg.layer(r, j)), path[at + 2:]
      value = jnp.stack([loop_params[path[:at] + (layer(r),) + rest][...]
                         for r in range(variable.shape[0])])
    else:
      value = loop_params[path][...]
    flat.append((path, variable.replace(value)))
  return nnx.merge(graphdef, nnx.from_flat_state(flat))


# Sweeps.

TWO_VARIANTS = """
def get_sweep():
  return [{"model.pos_emb": "rope", "model.norm_position": "pre"},
          {"model.pos_emb": "none", "model.norm_position": "post"}]
"""


def small_flags(cache_dir) -> list[str]:
  """A model and run small enough that train.py and eval.py take seconds."""
  return ["--config.model.d_model=32", "--config.model.num_layers=1",
          "--config.model.num_heads=2", "--config.model.d_ff=64",
          "--config.train.num_steps=6", "--config.train.batch_size=4",
          "--config.train.seq_len=32", "--config.train.log_every=2",
          "--config.train.eval_every=3", "--config.train.checkpoint_every=3",
          "--config.train.eval_steps=1", "--config.data.source=pydoc",
          "--config.tokenizer.vocab_size=300", "--config.model.vocab_size=320",
          f"--config.data.cache_dir={cache_dir}"]


def write_sweep(tmp_path, text: str, name: str = "s.py") -> str:
  path = tmp_path / name
  path.write_text(text)
  return str(path)


def sweep_cli(*args, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "sweep.py", *args], cwd=ROOT, capture_output=True,
                        text=True, timeout=300, check=False, env=env)


# Attention kernels against the reference.

def float32_tolerance() -> float:
  """The float32 kernels' tolerance: 1e-5 where float32 dots are exact but
  for rounding (the CPU, the interpreter); 5e-3 on a GPU, where float32 dots
  run in TF32 (a 10-bit mantissa), the compiled kernels' as XLA's at JAX's
  default precision: the worst case of the suite on an H200 was 2.3e-3
  (2026-12-04)."""
  return 5e-3 if jax.default_backend() == "gpu" else 1e-5


def kernel_tolerance(dtype) -> float:
  """max |kernel - oracle| / max(max |oracle|, 1) against the float32
  reference (see tests/test_flash_attention.py)."""
  return float32_tolerance() if dtype == jnp.float32 else 3e-2


def kernel_inputs(seed, B, T, S, H, K, D, dtype, D_v=None):
  """Random q, k, v and an output cotangent, in `dtype`; v and the cotangent
  `D_v` wide (None: D)."""
  D_v = D if D_v is None else D_v
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (B, T, H, D), dtype)
  k = jax.random.normal(keys[1], (B, S, K, D), dtype)
  v = jax.random.normal(keys[2], (B, S, K, D_v), dtype)
  do = jax.random.normal(keys[3], (B, T, H, D_v), dtype)
  return q, k, v, do


def random_segments(rng, B, L, mode):
  """Segment ids [B, L]: packed (ascending ids, trailing 0 padding) or random
  ids in 0..2 (0 = padding, so some query rows see no key at all)."""
  if mode == "packed":
    ids = np.sort(rng.randint(1, 4, size=(B, L)), axis=1)
    ids[:, L - rng.randint(0, L // 3 + 1):] = 0
  else:
    ids = rng.randint(0, 3, size=(B, L))
  return jnp.asarray(ids, jnp.int32)


def kernel_and_oracle(q, k, v, do, *, causal, q_seg, kv_seg, **blocks):
  """(out, dq, dk, dv) of the kernel, and of the reference in float32."""
  def kernel(q, k, v):
    return flash_attention(q, k, v, causal=causal, q_segment_ids=q_seg,
                           kv_segment_ids=kv_seg, **blocks)

  def oracle(q, k, v):
    segment_ids = None if q_seg is None else (q_seg, kv_seg)
    return attention(q, k, v, causal=causal, segment_ids=segment_ids,
                     implementation="reference")

  out, vjp = jax.vjp(kernel, q, k, v)
  got = (out, *vjp(do))
  f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
  with jax.default_matmul_precision("highest"):  # no TF32 oracle on a GPU
    ref_out, ref_vjp = jax.vjp(oracle, *f32[:3])
    return got, (ref_out, *ref_vjp(f32[3]))


def assert_kernel_close(actual, expected, dtype, name):
  """Within `kernel_tolerance(dtype)` of the oracle, and finite."""
  actual = np.asarray(actual.astype(jnp.float32))
  expected = np.asarray(expected)
  assert np.isfinite(actual).all(), f"{name}: not finite"
  err = np.abs(actual - expected).max() / max(np.abs(expected).max(), 1.0)
  assert err <= kernel_tolerance(dtype), f"{name}: relative error {err:.2e}"


# Hugging Face checkpoints and tokenizers.

BPE_TEXTS = ["def add(a, b):\n    return a + b\n" * 3, "class Foo: pass\n", "hello world"] * 5
TOKENIZER_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x * 2  # doubled\n",
    "Naïve café owners in Zürich don't serve crème brûlée.",
    "東京は日本の首都です。 Ελληνικά και русский язык.",
    "Numbers: 3.14159, 2024, 1e-5 and 42!",
    "emoji 😀👍🏽 family 👨‍👩‍👧 done",
] * 3


def save_hf(hf_model, tok, path, **kw):
  """A `transformers` model and our tokenizer saved as one model directory."""
  hf_model.save_pretrained(path, **kw)
  export_hf(tok, path)
  return str(path)


def run_convert(*args) -> int:
  """convert.py's exit status for `args`, run in this process."""
  try:
    convert.main([str(a) for a in args])
  except SystemExit as e:
    return e.code
  return 0


def convert_error_line(capsys, *args) -> str:
  """The one line convert.py prints on stderr when `args` are refused (exit 2)."""
  capsys.readouterr()  # transformers' progress bars while saving
  assert run_convert(*args) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: ")
  return err


def edit_hf_config(hf_dir, **changes):
  path = hf_dir / "config.json"
  path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def assert_close(ours, theirs):
  """Within 1e-4 of the largest magnitude of `theirs` (logits against transformers)."""
  ours, theirs = np.asarray(ours, np.float32), np.asarray(theirs, np.float32)
  assert ours.shape == theirs.shape
  scale = np.abs(theirs).max()
  np.testing.assert_array_less(np.abs(ours - theirs).max(), 1e-4 * scale)


def tiny_gpt2(**kw):
  """A tiny random `transformers` GPT-2: 320 ids, 64 positions, 2 layers of
  width 32 (GPT2Config fields in `kw` override them)."""
  import transformers  # pylint: disable=import-outside-toplevel
  return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**dict(
      vocab_size=320, n_positions=64, n_embd=32, n_layer=2, n_head=4), **kw}))


def tiny_llama(cls=None, config=None, **kw):
  """A tiny random `transformers` LLaMA-like model: `cls` (default
  LlamaForCausalLM) built from `config` (default LlamaConfig) and `kw`."""
  import transformers  # pylint: disable=import-outside-toplevel
  cls, config = cls or transformers.LlamaForCausalLM, config or transformers.LlamaConfig
  args = dict(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
  return cls(config(**{**args, **kw}))


def randomised(hf_model):
  """`hf_model` with its biases and LayerNorm parameters drawn at random
  (initialised to zeros and ones, they would not show a misplaced tensor)."""
  import torch  # pylint: disable=import-outside-toplevel
  with torch.no_grad():
    for name, parameter in hf_model.named_parameters():
      if name.endswith("bias") or "LayerNorm" in name:
        torch.nn.init.normal_(parameter, mean=float(name.endswith("weight")), std=0.5)
  return hf_model


def t5_like() -> tuple[Tokenizer, dict]:
  """A T5-style Unigram tokenizer trained on `TOKENIZER_CORPUS`, and its specials."""
  tok = Tokenizer(models.Unigram())
  tok.normalizer = normalizers.Sequence([normalizers.Nmt(), normalizers.NFKC(),
                                         normalizers.Replace(Regex(" {2,}"), " ")])
  tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
  tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
  tok.train_from_iterator(TOKENIZER_CORPUS, trainers.UnigramTrainer(
      vocab_size=150, special_tokens=["<pad>", "</s>", "<unk>"], unk_token="<unk>",
      show_progress=False))
  tok.post_processor = processors.TemplateProcessing(
      single="$A </s>", pair="$A </s> $B:1 </s>:1",
      special_tokens=[("</s>", tok.token_to_id("</s>"))])
  extras = [f"<extra_id_{i}>" for i in range(3)]
  return tok, {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>",
               "extra_special_tokens": extras}
