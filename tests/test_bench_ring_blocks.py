"""bench/ring_blocks.py on the CPU: the ring's three kernel calls per device."""
import pytest

from bench import ring_blocks


def test_ring_calls_cover_a_devices_share_of_the_causal_row():
  """Diagonal (causal T x T) plus n - 1 calls of T x T/2 pairs: a device's
  share, L^2 / (2 n) pairs, of the causal row."""
  case = dict(L=4096, n=8, H=1, K=1, D=64)
  c = ring_blocks.calls(case)
  T = case["L"] // case["n"]
  assert c == {"diagonal": (T, T, True), "before": (T, T // 2, False),
               "after": (T // 2, T, False)}
  pairs = T * T / 2 + (case["n"] - 1) / 2 * (T * T / 2 + T * T / 2)
  assert pairs == case["L"] ** 2 / 2 / case["n"]


@pytest.mark.slow
def test_quick_run_times_every_call_and_the_whole_row():
  case = ring_blocks.ring_cases(quick=True)[0]
  row = ring_blocks.measure(case, None, warmup=0, repeats=1)
  assert set(row["calls"]) == {"diagonal", "before", "after"}
  for r in row["calls"].values():
    for key in ("parts_fwd", "parts_bwd", "plain_fwd", "plain_fwd_bwd", "fwd_tflops",
                "bwd_tflops"):
      assert r[key] > 0, key
  assert row["ring_ms"] > 0 and row["efficiency"] > 0
  lines = ring_blocks.table([row]).splitlines()
  assert len(lines) == 2 + 4 and "ring (one device)" in lines[-1]
