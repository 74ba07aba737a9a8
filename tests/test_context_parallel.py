"""Context parallelism (`mesh.context`, `model/context_parallel.py`): the
zig-zag layout and its causal load balance, the ring and the all-gather
against the reference attention (outputs and gradients), training on 8 CPU
devices equal to one device, and the one-line refusals."""
import numpy as np
import pytest

from configs import base
from configs.errors import UserError
from configs.validation import validate
from model import context_parallel as cp
from model.attention import check_context
from model.config import ModelConfig
from training import steps
from tests.test_sharding import run_on_8_devices


@pytest.mark.parametrize("n,layout", [(4, "zigzag"), (8, "zigzag"), (4, "contiguous")])
def test_layout_round_trip(n, layout):
  x = np.arange(2 * 64 * 3).reshape(2, 64, 3)
  laid = np.asarray(cp.to_layout(x, n, layout))
  np.testing.assert_array_equal(laid, x[:, cp.row_order(64, n, layout)])
  np.testing.assert_array_equal(np.asarray(cp.from_layout(laid, n, layout)), x)
  block = 64 // n
  for d in range(n):  # each device's block holds the row indices token_index says
    np.testing.assert_array_equal(cp.row_order(64, n, layout)[d * block:(d + 1) * block],
                                  np.asarray(cp.token_index(d, n, layout, block)))


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_zigzag_balances_causal_work(n):
  """Every device's causal work within 5% of the mean with zig-zag (it is
  equal); the contiguous split gives the last device n times the first's.
  With the fully masked chunk pairs skipped, neither computes more than the
  (T^2 / 2)(1 + 1/n) pairs of the causal triangle and its diagonal blocks."""
  T = 131072
  work = cp.causal_work(T, n, "zigzag")
  assert np.abs(work / work.mean() - 1).max() <= 0.05
  contiguous = cp.causal_work(T, n, "contiguous")
  assert contiguous[-1] / contiguous[0] == n
  assert work.sum() <= contiguous.sum() <= T * T / 2 * (1 + 1 / n)


def test_auto_strategy_rule():
  assert cp.choose_strategy("auto", num_heads=32, num_kv_heads=8, n=4) == "all_gather"
  assert cp.choose_strategy("auto", num_heads=32, num_kv_heads=32, n=4) == "ring"
  assert cp.choose_strategy("auto", num_heads=32, num_kv_heads=8, n=8) == "ring"
  assert cp.choose_strategy("ring", num_heads=32, num_kv_heads=1, n=2) == "ring"


def _config(**mesh):
  c = base.get_config()
  c.model.update(vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 d_ff=128, max_len=1024, attention_impl="xla")
  c.train.seq_len = 1024
  c.tokenizer.vocab_size = 128
  c.mesh.update(**mesh)
  return c


@pytest.mark.parametrize("overrides,message", [
    (dict(train=dict(seq_len=1020)),
     "train.seq_len=1020: must be a multiple of 2 x mesh.context = 8"),
    (dict(model=dict(family="encoder", pos_emb="learned"), train=dict(objective="mlm")),
     "mesh.context=4: splits the sequence of a decoder's rows; model.family=encoder"),
    (dict(mesh=dict(context_strategy="tree")), "mesh.context_strategy='tree': must be one of"),
])
def test_bad_combinations_are_one_line(overrides, message):
  c = _config(context=4)
  for section, values in overrides.items():
    c[section].update(**values)
  with pytest.raises(UserError, match="^config field " + message) as err:
    validate(c)
  assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,message", [
    (dict(attention_impl="cudnn", dtype="bfloat16"),
     "model.attention_impl='cudnn': mesh.context=4 takes no attention_impl=cudnn"),
    (dict(pos_emb="alibi"), "model.pos_emb='alibi': mesh.context=4 takes no additive bias"),
    (dict(attention_score="sigmoid"),
     "model.attention_score='sigmoid': mesh.context=4 takes no attention score 'sigmoid'"),
])
def test_what_the_ring_does_not_take_is_refused_at_start(overrides, message):
  c = _config(context=4)
  c.model.update(**overrides)
  with pytest.raises(UserError, match="^config field " + message) as err:
    steps.abstract_state(c)
  assert "\n" not in str(err.value)
  check_context(ModelConfig.resolve(c.model), 1)  # one device: nothing to refuse


ATTENTION = """
from model.attention import AttentionOptions, attention
from model import context_parallel as cp
from jax.sharding import Mesh

cp.TILE = 4  # chunks of 8 and 16 tokens: two or four tiles each, some skipped
B, T, H, K, D = 2, 64, 4, 2, 8
ks = jax.random.split(jax.random.key(0), 4)
q = jax.random.normal(ks[0], (B, T, H, D))
k, v = (jax.random.normal(x, (B, T, K, D)) for x in ks[1:3])
do = jax.random.normal(ks[3], q.shape)
seg = jnp.concatenate([jnp.full((B, 20), 1), jnp.full((B, 30), 2), jnp.zeros((B, 14), int)], 1)
CASES = CASE_LIST
out = {}
for name, n, layout, strategy, opts, kernel in CASES:
  mesh = Mesh(np.array(jax.devices()[:n]), ("context",))
  fn = {"ring": cp.ring_attention, "all_gather": cp.all_gather_attention}[strategy]
  plain = AttentionOptions(**{k: v for k, v in opts.items() if k != "segment_ids"})
  lay = lambda x: cp.to_layout(x, n, layout)
  spec = P(None, "context")

  segs = (lay(seg),) if "segment_ids" in opts else ()

  def ours(q, k, v):
    local = lambda q, k, v, *s: fn(q, k, v, *s, *s, options=plain, axis="context",
                                   layout=layout, kernel=kernel)
    run = jax.shard_map(local, mesh=mesh, in_specs=(spec,) * (3 + len(segs)), out_specs=spec,
                        check_vma=False)
    return cp.from_layout(run(lay(q), lay(k), lay(v), *segs), n, layout)

  reference = lambda q, k, v: attention(q, k, v, AttentionOptions(**opts))
  got, got_vjp = jax.vjp(jax.jit(ours), q, k, v)
  want, want_vjp = jax.vjp(reference, q, k, v)
  pairs = zip((got, *got_vjp(do)), (want, *want_vjp(do)))
  out[name] = [float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in pairs]
print(json.dumps(out))
"""


JAX_CASES = """[
    ("ring_zigzag", 4, "zigzag", "ring", dict(causal=True, segment_ids=seg), None),
    ("ring_8_window_softcap", 8, "zigzag", "ring",
     dict(causal=True, segment_ids=seg, window=7, softcap=2.0), None),
    ("ring_bidirectional", 4, "contiguous", "ring", dict(segment_ids=seg), None),
    ("all_gather", 4, "zigzag", "all_gather", dict(causal=True, segment_ids=seg, softcap=2.0),
     None),
]"""

KERNEL = 'dict(lowering=LOWERING, device=jax.devices()[0])'
KERNEL_CASES = f"""[
    ("ring_zigzag", 4, "zigzag", "ring", dict(causal=True, segment_ids=seg, softcap=2.0),
     {KERNEL}),
    ("ring_8", 8, "zigzag", "ring", dict(causal=True), {KERNEL}),
    ("ring_bidirectional", 4, "contiguous", "ring", dict(segment_ids=seg), {KERNEL}),
    ("all_gather", 4, "zigzag", "all_gather", dict(causal=True, segment_ids=seg), {KERNEL}),
]"""


def test_ring_and_all_gather_equal_the_reference():
  """Output and dQ, dK, dV of each strategy within 1e-5 (relative to the
  largest) of the reference on the whole row: GQA, packed segments with
  padding, causal (zig-zag, 4 and 8 devices) and bidirectional (contiguous),
  a sliding window and a soft-cap; chunks cut into several tiles."""
  out = run_on_8_devices(ATTENTION.replace("CASE_LIST", JAX_CASES))
  for name, errors in out.items():
    assert max(errors) < 1e-5, (name, errors)


@pytest.mark.slow  # make test runs the kernels in the ring through training, below
@pytest.mark.parametrize("lowering", ["triton", "mosaic_tpu"])
def test_ring_and_all_gather_of_our_kernels_equal_the_reference(lowering):
  """The same with our Pallas kernels as the blocks (`KernelBlocks`, in their
  interpreters): the three zig-zag cases (diagonal, keys before, keys after)
  with segments and a soft-cap, 8 devices, bidirectional, the all-gather."""
  cases = KERNEL_CASES.replace("LOWERING", repr(lowering))
  out = run_on_8_devices(ATTENTION.replace("CASE_LIST", cases))
  for name, errors in out.items():
    assert max(errors) < 1e-5, (name, errors)


TRAINING = """
from model import context_parallel as cp
from training import steps

cp.TILE = 32  # several tiles per chunk

def config(seq_len, impl="xla", **mesh):
  c = base.get_config()
  c.model.update(vocab_size=128, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 d_ff=128, max_len=seq_len, attention_impl=impl)
  c.model.update(**MODEL)
  c.train.seq_len = seq_len
  c.mesh.update(**mesh)
  return c

T, B = SEQ_LEN, 4
rng = np.random.default_rng(0)
inputs = rng.integers(1, 128, (B, T)).astype(np.int32)
seg, pos = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
for b in range(B):  # three documents and padding per row, at random places
  bounds = [0, *np.sort(rng.integers(1, T, 3)), T]
  for i in range(4):
    seg[b, bounds[i]:bounds[i + 1]] = i + 1 if i < 3 else 0
    pos[b, bounds[i]:bounds[i + 1]] = np.arange(bounds[i + 1] - bounds[i])
batch = dict(inputs=inputs, targets=np.roll(inputs, -1, 1), segment_ids=seg, positions=pos,
             loss_mask=(seg > 0).astype(np.float32))
c = config(T)
graphdef, _ = steps.abstract_state(c)
params = nnx.state(build_model(c.model, nnx.Rngs(0)), nnx.Param)
grads = lambda p, b: steps._grads(graphdef, p, b, "next_token", 1)
want_g, want_sums = jax.jit(grads)(params, batch)
out = {}
for mesh, strategy in MESHES:
  c = config(T, IMPL, **mesh)
  m = sharding.make_mesh(c.mesh)
  step = jax.jit(steps.traced_on(m, grads, strategy))
  g, sums = step(params, jax.device_put(batch, sharding.batch_sharding(m)))
  name = "_".join(f"{k}{v}" for k, v in mesh.items()) + "_" + strategy + "_" + IMPL
  out[name] = [abs(float(sums[0]) / float(want_sums[0]) - 1)] + [
      float(jnp.abs(a - b).max() / jnp.abs(b).max())
      for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(want_g))]
  if strategy == "ring":
    hlo = step.lower(params, jax.device_put(batch, sharding.batch_sharding(m))).compile().as_text()
    out[name + "_collectives"] = [hlo.count("collective-permute"), hlo.count("all-gather")]
print(json.dumps(out))
"""


def _train_check(seq_len, meshes, impl="xla", model=None):
  code = TRAINING.replace("SEQ_LEN", str(seq_len)).replace("MESHES", repr(meshes)).replace(
      "IMPL", repr(impl)).replace("MODEL", repr(model or {}))
  return run_on_8_devices(code)


# xla is slow: pallas runs the same step, meshes and strategies (the ring's
# machinery is the same; its blocks our kernels), and
# test_ring_and_all_gather_equal_the_reference checks the JAX blocks.
@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "pallas"])
def test_training_on_context_and_fsdp_equals_one_device(impl):
  """configs/tiny.py-like GQA with packed documents at seq_len 1024: the loss
  and every gradient under mesh.context=4 x fsdp=2 (ring and all-gather;
  JAX blocks and our kernels in the interpreter) within 1e-5 relative of one
  device's (xla); the ring's step moves K/V by collective-permutes and
  gathers no K/V."""
  out = _train_check(1024, [(dict(data=1, fsdp=2, context=4), "ring"),
                            (dict(data=1, fsdp=2, context=4), "all_gather")], impl)
  for name, errors in out.items():
    if name.endswith("_collectives"):
      assert errors[0] > 0 and errors[1] == 0, (name, errors)
    else:
      assert max(errors) < 1e-5, (name, errors)


# Multi-head latent attention: queries and keys 12 wide, values 8 (model/mla.py).
MLA = dict(attention="mla", num_kv_heads=None, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=8)


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "pallas"])
def test_latent_attention_on_context_devices_equals_one_device(impl):
  """MLA's values, narrower than its keys, through the ring (padded to the
  keys' width, output cut back): the loss and every gradient under
  mesh.context=2 x fsdp=4 within 1e-5 relative of one device's."""
  out = _train_check(256, [(dict(data=1, fsdp=4, context=2), "ring")], impl, MLA)
  for name, errors in out.items():
    if not name.endswith("_collectives"):
      assert max(errors) < 1e-5, (name, errors)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_training_on_eight_context_devices_equals_one_device(impl):
  out = _train_check(1024, [(dict(data=1, fsdp=1, context=8), "ring"),
                            (dict(data=1, fsdp=1, context=8), "all_gather"),
                            (dict(data=1, fsdp=2, context=2, tensor=2), "ring")], impl)
  for name, errors in out.items():
    if not name.endswith("_collectives"):
      assert max(errors) < 1e-5, (name, errors)


HYBRID = dict(num_layers=2, layer_types=("linear_attention", "full_attention"),
              linear_chunk_size=8)


def test_hybrid_training_on_context_devices_equals_one_device():
  """A tiny hybrid (a Gated DeltaNet layer, then a full one) with packed
  documents at seq_len 64: the loss and every gradient on mesh.context=8,
  context=4 x fsdp=2 and context=2 x data=2 x tensor=2 within 1e-5 relative
  of one device's; the linear layers' chunks of the row (4, 8 and 16 tokens)
  are shorter than, as long as and longer than the rule's chunk of 8
  (`model/linear_context.py`)."""
  out = _train_check(64, [(dict(data=1, fsdp=1, context=8), "ring"),
                          (dict(data=1, fsdp=2, context=4), "ring"),
                          (dict(data=2, fsdp=1, context=2, tensor=2), "all_gather")],
                     model=HYBRID)
  for name, errors in out.items():
    if not name.endswith("_collectives"):
      assert max(errors) < 1e-5, (name, errors)


def test_summary_prints_attention_flops_per_device():
  """`python -m model.summary` with mesh.context: every device's attention
  FLOPs equal under the zig-zag layout; the contiguous split's busiest
  device does 2n / (n + 1) times the mean."""
  from model import summary  # pylint: disable=import-outside-toplevel
  c = _config(context=4)
  flops = summary.summarize(c, "tpu")["context_attention_flops"]
  assert len(set(flops["zigzag"])) == 1
  contiguous = flops["contiguous"]
  assert max(contiguous) * 4 / sum(contiguous) == pytest.approx(2 * 4 / 5)
  assert "Attention FLOPs per device" in summary.format_table(c, summary.summarize(c, "tpu"))


@pytest.mark.parametrize("impl", [pytest.param("xla", marks=pytest.mark.slow), "pallas"])
def test_compile_for_a_v5e_slice_with_the_context_axis(impl):
  """compile.py for 4 v5e chips, mesh.context=4: the ring's collective-permutes
  and no all-gather (the K/V stay split), and every device's attention FLOPs
  equal under the zig-zag layout; with pallas, Mosaic TPU kernels whose
  queries are the device's quarter of the row (32 of 128 tokens, 16 for the
  half-block steps) in the kernels' [rows, heads, T, D] layout."""
  import json  # pylint: disable=import-outside-toplevel
  from tests.test_compile import compile_cli  # pylint: disable=import-outside-toplevel
  result = compile_cli("--config", "configs/tiny.py", "--target", "tpu:v5e:2x2",
                       "--config.mesh.context=4", "--config.mesh.data=1",
                       "--config.mesh.context_strategy=ring",
                       f"--config.model.attention_impl={impl}", "--json")
  assert result.returncode == 0, result.stderr
  report = json.loads(result.stdout)
  assert report["mesh"] == {"data": 1, "fsdp": 1, "expert": 1, "context": 4, "tensor": 1}
  assert report["collectives"]["collective-permute"]["count"] > 0
  assert "all-gather" not in report["collectives"]
  # Asynchronous on the TPU, nearly all with a block's compute between start
  # and done (the ring's sends, forward and pipelined backward).
  overlap = report["async_overlap"]["collective-permute"]
  assert overlap["overlapped"] >= 0.9 * overlap["async"] > 0
  flops = report["context_attention_flops_per_device"]
  assert len(set(flops["zigzag"])) == 1 and len(set(flops["contiguous"])) == 4
  if impl == "pallas":
    forward = report["kernels"]["flash_attention_tpu_forward"]
    assert forward["lowering"] == "mosaic_tpu"
    assert {"f32[16,4,32,64]", "f32[16,4,16,64]"} <= set(forward["results"])
    assert {"flash_attention_tpu_dq", "flash_attention_tpu_dkdv"} <= set(report["kernels"])


@pytest.mark.slow
def test_bench_prints_memory_and_step_time_per_context(tmp_path):
  """`python -m bench.context_parallel` on 4 CPU devices: a row per (seq_len,
  context) with the compiler's memory, the ring's collective-permutes where
  context > 1 (none at 1), and a step time; the JSON holds the same rows."""
  import json  # pylint: disable=import-outside-toplevel
  from tests.helpers import python_on_cpu_devices  # pylint: disable=import-outside-toplevel
  out = tmp_path / "cp.json"
  result = python_on_cpu_devices(
      ["-m", "bench.context_parallel", "--config", "configs/tiny.py",
       "--config.model.num_layers=1", "--seq_lens", "128", "--contexts", "1,4", "--steps", "1",
       "--strategy", "ring", "--out", out], 4)
  assert result.returncode == 0, result.stderr[-3000:]
  assert "| seq_len | context |" in result.stdout
  rows = json.loads(out.read_text())["rows"]
  assert [(r["seq_len"], r["context"]) for r in rows] == [(128, 1), (128, 4)]
  assert "collective-permute" not in rows[0]["collectives"]
  assert rows[1]["collectives"]["collective-permute"] > 0
  assert all(r["peak_bytes"] > 0 and r["step_seconds"] > 0 for r in rows)
