"""bench/attention.py's packed row, on the CPU: its segment ids are what
`data.packing=packed` trains on, and every competitor gets them."""
import numpy as np
import pytest

from bench import attention as bench_attention


def _packed(quick: bool) -> dict:
  return next(c for c in bench_attention.grid_cases(quick) if c.get("packed"))


def test_packed_row_has_whole_documents_of_an_eighth_to_a_half():
  case = _packed(quick=False)
  assert (case["label"], case["S"], case["D"], case["causal"]) == (
      "gpt2-small-packed", 1024, 64, True)
  ids = np.asarray(bench_attention.segment_ids(case))
  assert ids.shape == (case["B"], case["S"])
  for row in ids:
    assert row[0] == 1 and (np.diff(row) >= 0).all() and (np.diff(row) <= 1).all()
    lengths = np.bincount(row)[1:]
    assert (lengths[:-1] >= 128).all() and (lengths <= 512).all()  # the last one cut


def test_every_competitor_gets_the_segment_ids():
  case = _packed(quick=True)
  q, k, v, _ = bench_attention.make_inputs(case)
  want = bench_attention.attention_fn("xla", case)(q, k, v)
  ours = bench_attention.attention_fn("ours_triton", case)(q, k, v)
  assert np.abs(np.asarray(ours, np.float32) - np.asarray(want, np.float32)).max() < 3e-2
  unpacked = bench_attention.attention_fn("xla", dict(case, packed=False))(q, k, v)
  assert np.abs(np.asarray(unpacked, np.float32) - np.asarray(want, np.float32)).max() > 0.1
  with pytest.raises(ValueError, match="no segment ids"):
    bench_attention.attention_fn("jax_mosaic", case)


@pytest.mark.slow
def test_tpu_competitors_get_the_segment_ids():
  """On a TPU the bench runs ours (mosaic_tpu) beside JAX's splash attention;
  here both run interpreted and match XLA with the packed row's dense mask."""
  case = _packed(quick=True)
  q, k, v, _ = bench_attention.make_inputs(case)
  want = np.asarray(bench_attention.attention_fn("xla", case)(q, k, v), np.float32)
  for name in ("ours_tpu", "jax_splash"):
    got = np.asarray(bench_attention.attention_fn(name, case)(q, k, v), np.float32)
    assert np.abs(got - want).max() < 3e-2, name
  assert bench_attention.competitors("tpu") == bench_attention.TPU_COMPETITORS


def test_rows_select_grid_rows_by_shape_and_the_others_by_label():
  """`--rows 64:4096:yes` is the grid row alone, not the GQA row of the same
  D, S and mask; `gqa` selects that one."""
  names = [bench_attention.row_name(c) for c in bench_attention.grid_cases(quick=False)]
  assert len(names) == len(set(names))
  assert {"64:4096:yes", "gqa", "gpt2-small", "gpt2-small-packed"} <= set(names)
