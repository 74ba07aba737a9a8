"""bench/moe.py on the CPU: its dense MLP is the grouped MLP of one expert,
its implementations give the outputs they should, and `--quick` runs and
writes its table and JSON."""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np

from bench import moe as bench_moe
from model.mlp import MLPS
from model.moe import grouped_mlp


def test_grouped_mlp_of_one_expert_is_the_dense_mlp():
  """E = 1, k = 1: the comparison's two sides compute the same function."""
  case = dict(label="one", N=48, d=32, E=1, k=1, f=64, mlp="swiglu")
  inputs = bench_moe.make_inputs(case)
  for mlp in ("gelu_tanh", "swiglu"):
    up, gate, down = inputs["dense"]
    gate = gate if MLPS[mlp].gated else None
    opts = dict(activation=MLPS[mlp].activation, dtype=jnp.bfloat16)
    want = jax.jit(functools.partial(bench_moe.dense_mlp, **opts))(inputs["x"], up, gate, down)
    got = jax.jit(functools.partial(grouped_mlp, **opts))(
        inputs["x"], jnp.array([48], jnp.int32), up[None], None if gate is None else gate[None],
        down[None])
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2)
    assert float(jnp.abs(want).max()) > 0.1


def _outputs(case: dict) -> dict:
  impls = bench_moe.implementations(case, bench_moe.make_inputs(case))
  assert tuple(impls) == bench_moe.IMPLS
  return {name: fn(fixed, *diff) for name, (fn, fixed, diff) in impls.items()}


def test_implementations_give_their_output_shapes():
  """At the full shapes too: traced (`jax.eval_shape`), not run."""
  for quick in (True, False):
    for case in bench_moe.cases(quick):
      N, d, k = case["N"], case["d"], case["k"]
      shapes = {name: out.shape
                for name, out in jax.eval_shape(functools.partial(_outputs, case)).items()}
      assert shapes == {"dense": (N, d), "grouped": (N * k, d), "moe_layer": (N, d)}


def test_quick_run_prints_the_table_and_writes_json(tmp_path, capsys, monkeypatch):
  """`--quick` on its fine-grained case alone (each case is 6 compiles)."""
  case = bench_moe.cases(quick=True)[1]
  monkeypatch.setattr(bench_moe, "cases", lambda quick: [case] if quick else [])
  out = tmp_path / "moe.json"
  report = bench_moe.main(["--quick", "--warmup", "0", "--repeats", "1", "--out", str(out)])
  assert json.loads(out.read_text()) == report
  for key in ("date", "device", "backend", "jax", "commit", "command", "warmup", "repeats"):
    assert key in report["meta"], key
  rows = report["rows"]
  assert [(r["case"]["label"], r["impl"]) for r in rows] == [
      ("fine-grained", impl) for impl in bench_moe.IMPLS]
  for row in rows:
    assert row["case"]["flops"] == bench_moe.nominal_flops(row["case"])
    for mode in bench_moe.MODES:
      result = row[mode]
      assert "error" not in result, result
      assert result["ms"] > 0 and result["tflops"] > 0 and result["vs_dense"] > 0
  dense, grouped = rows[0]["fwd_bwd"], rows[1]["fwd_bwd"]
  assert rows[0]["fwd"]["vs_dense"] == 1.0
  # On the CPU ragged_dot runs as dense dots over groups padded to all rows: E x.
  assert 0.9 < dense["xla_flops_ratio"] < 1.2 and grouped["xla_flops_ratio"] > case["E"] / 2
  table = capsys.readouterr().out
  assert table.count("| fine-grained (") == len(bench_moe.IMPLS)
  assert "| fwd+bwd ÷ dense |" in table and f"wrote {out}" in table
