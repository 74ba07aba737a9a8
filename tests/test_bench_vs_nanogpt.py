"""bench/vs_nanogpt.py without a nanoGPT checkout: our config mapped onto
nanoGPT's train.py, the configs it cannot express refused in one line, its
log and ours parsed, the token stream rebuilt from concat rows. The
comparison itself (two train.py loops, minutes) is not a test."""
import numpy as np
import pytest

from bench import vs_nanogpt
from configs import tiny_gpt2
from configs.errors import UserError
from tests.helpers import assert_one_line_error, run_python


def _config(steps=40, **model):
  c = tiny_gpt2.get_config()
  c.model.update(model)
  return vs_nanogpt.bench_config(c, steps=steps, log_every=1, tokenizer_dir="tok")


def test_tiny_gpt2_maps_onto_nanogpt_settings():
  config = _config()
  s = vs_nanogpt.nanogpt_settings(config, data_dir="/data", compile_model=False)
  assert (s["n_layer"], s["n_head"], s["n_embd"], s["bias"], s["block_size"],
          s["batch_size"], s["gradient_accumulation_steps"]) == (2, 4, 128, True, 128, 16, 1)
  assert (s["max_iters"], s["lr_decay_iters"], s["warmup_iters"]) == (39, 40, 50)
  assert s["min_lr"] == pytest.approx(3e-4) and (s["beta1"], s["beta2"]) == (0.9, 0.95)
  assert (s["dtype"], s["device"], s["dropout"], s["always_save_checkpoint"]) == (
      "float32", "cpu", 0.0, False)
  assert s["eval_interval"] > s["max_iters"] and s["log_interval"] == 1
  executed = {}
  exec(vs_nanogpt.settings_file(s), executed)  # pylint: disable=exec-used  # as nanoGPT does
  assert {k: executed[k] for k in s} == s
  t = config.train
  assert (t.num_steps, t.log_every, t.eval_every, t.checkpoint_every, t.trackers) == (
      40, 1, 40, 40, "")


@pytest.mark.parametrize("change, fragment", [
    (dict(pos_emb="rope"), "model.pos_emb='rope'"),
    (dict(norm="rmsnorm"), "model.norm='rmsnorm'"),
    (dict(mlp="gelu_tanh"), "model.mlp='gelu_tanh'"),
    (dict(use_bias=False), "model.use_bias=False"),
    (dict(num_kv_heads=2), "model.num_kv_heads"),
    (dict(d_ff=384), "--config.model.d_ff=512"),
    (dict(max_len=256), "--config.model.max_len=128"),
    (dict(qk_norm=True), "model.qk_norm=True"),
])
def test_what_nanogpt_cannot_express_is_refused(change, fragment):
  with pytest.raises(UserError, match="nanoGPT cannot express") as e:
    _config(**change)
  assert fragment in str(e.value) and "\n" not in str(e.value)


def test_packed_rows_and_remat_are_refused():
  c = tiny_gpt2.get_config()
  c.data.packing = "packed"
  with pytest.raises(UserError, match="--config.data.packing=concat"):
    vs_nanogpt.bench_config(c, steps=20, log_every=1, tokenizer_dir="tok")
  c = tiny_gpt2.get_config()
  c.train.remat = "full"
  with pytest.raises(UserError, match="--config.train.remat=none"):
    vs_nanogpt.bench_config(c, steps=20, log_every=1, tokenizer_dir="tok")


NANOGPT_LOG = """tokens per iteration will be: 2,048
found vocab_size = 1024 (inside data/meta.pkl)
Initializing a new model from scratch
number of parameters: 0.53M
num decayed parameter tensors: 10, with 540,672 parameters
step 0: train loss 6.9515, val loss 6.9526
iter 0: loss 6.9550, time 812.04ms, mfu -100.00%
iter 1: loss 6.9012, time 61.50ms, mfu -100.00%
iter 2: loss 6.8420, time 59.25ms, mfu -100.00%
"""


def test_nanogpt_log_is_parsed():
  losses, ms, params = vs_nanogpt.parse_nanogpt(NANOGPT_LOG)
  assert losses == [6.955, 6.9012, 6.842] and ms == [812.04, 61.5, 59.25] and params == 0.53
  with pytest.raises(ValueError, match="log_interval"):
    vs_nanogpt.parse_nanogpt(NANOGPT_LOG.replace("iter 1:", "iter 5:"))


def test_windows_and_what_is_counted():
  lines = [{"step": s, "split": "train", "loss": 7.0 - s, "seconds": 0.1 * w}
           for s, w in ((2, 2), (4, 2), (6, 2))] + [{"step": 6, "split": "validation"}]
  losses, windows = vs_nanogpt.parse_ours(lines)
  assert losses == [5.0, 3.0, 1.0]
  assert windows == [(2, pytest.approx(100.0)), (4, pytest.approx(100.0)),
                     (6, pytest.approx(100.0))]
  assert vs_nanogpt.windowed([1.0, 3.0, 5.0, 7.0, 9.0], 2) == [(2, 2.0), (4, 6.0), (5, 9.0)]
  # The first 2 steps are skipped: windows (3, 4] and (4, 5] count.
  assert vs_nanogpt.counted([(2, 2.0), (4, 6.0), (5, 9.0)], skip=2, log_every=2) == [6.0, 9.0]


def test_token_stream_of_concat_rows():
  stream, T = np.arange(23, dtype=np.int32), 5

  def row(r):
    window = stream[r * T:r * T + T + 1]
    n = len(window) - 1
    inputs, targets, mask = (np.zeros(T, np.int32), np.zeros(T, np.int32),
                             np.zeros(T, np.float32))
    inputs[:n], targets[:n], mask[:n] = window[:-1], window[1:], 1.0
    return {"inputs": inputs, "targets": targets, "loss_mask": mask}

  np.testing.assert_array_equal(vs_nanogpt.token_stream(-(-22 // T), row), stream)


def test_command_refuses_a_config_in_one_line(tmp_path):
  for name in ("train.py", "configurator.py", "model.py"):
    (tmp_path / name).write_text("")
  result = run_python(["-m", "bench.vs_nanogpt", f"--nanogpt_dir={tmp_path}",
                       "--config=configs/tiny.py"])
  assert result.returncode == 2
  assert_one_line_error(result, "error: model.pos_emb='rope': nanoGPT cannot express it")
  result = run_python(["-m", "bench.vs_nanogpt", f"--nanogpt_dir={tmp_path / 'none'}"])
  assert result.returncode == 2
  assert_one_line_error(result, "no nanoGPT train.py", "git clone")
