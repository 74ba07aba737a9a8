"""bench/cpu_roofline.py: `bench.roofline --target cpu` reads the train step
compiled for this CPU; its bytes agree with XLA's cost analysis, its FLOPs
(dots only) are most of the compiler's (which counts elementwise ops too)."""
import pytest

from bench.cpu_roofline import cpu_report
from configs import tiny_gpt2


@pytest.mark.slow  # a compile: about 10 s on 2 idle cores
def test_cpu_roofline_of_a_small_gpt2_step():
  c = tiny_gpt2.get_config()
  c.model.update(vocab_size=256, d_model=32, d_ff=128, max_len=32)
  c.tokenizer.vocab_size = 256
  c.train.update(batch_size=2, seq_len=32)
  report = cpu_report(c, {"peak_flops": 1e11, "bandwidth": 1e10, "source": "stated"})
  once, cost = report["loop_bodies_once"], report["compiler_cost_analysis"]
  assert 0.7 * cost["flops"] <= once["flops"] <= cost["flops"]
  assert once["bytes"] == pytest.approx(cost["bytes"], rel=0.1)
  assert {"attention", "mlp", "head and loss", "optimizer"} <= set(report["groups"])
  total = report["total"]
  assert total["step_seconds"] >= max(total["flops"] / 1e11, total["bytes"] / 1e10) * 0.999
  assert 0 < report["mfu_bound"] <= 1
