"""Block-sparse tile plans (`model.kernels.block_sparse`) as the Hopper
kernels receive them: exact plans for one packed layout, and, for random
layouts, that a plan visits every tile pair with a visible key and leaves
unmasked only pairs that see their whole tile."""
import dataclasses

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest

from model.kernels import common
from model.kernels import flash_attention_hopper as hopper
from tests.segments import DOCUMENTS_KV, DOCUMENTS_Q, documents


def _config(causal: bool, q_len: int, block_q_dkv: int = 64, window: int | None = None):
  return hopper._Config(scale=1.0, causal=causal, softcap=None, segments=True, window=window,
                        q_len=q_len, kv_len=q_len, group=1,
                        blocks=hopper.HopperBlocks(64, block_q_dkv, 2), interpret=True)


def _plans(causal: bool):
  q_seg = common.pad_segment_ids(documents(320, DOCUMENTS_Q), 384)
  kv_seg = common.pad_segment_ids(documents(320, DOCUMENTS_KV), 384)
  cfg = _config(causal, 384)
  query = hopper._query_plan(q_seg, kv_seg, 64, cfg)
  key = hopper._key_plan(q_seg, kv_seg, cfg)
  return [[np.asarray(x)[0].tolist() for x in plan] for plan in (query, key)]


def test_plans_of_packed_documents():
  """The plans of the layout `test_block_sparse_plan_matches_reference`
  runs (tiles of 64; CTAs of two warpgroups), worked by hand. Bounds are
  (first, split, count) per warpgroup; only the first `count` tiles of a
  CTA's list are streamed, the masked ones first."""
  (tiles, bounds), (key_tiles, key_bounds) = _plans(causal=True)
  # Forward/dQ, causal. CTA 0: key tiles 0 and 1, each on the diagonal of
  # one warpgroup; warpgroup 1 (document 2) passes tile 0 (document 1).
  # CTA 1: key tile 0 skipped (document 1), 1 to 3 masked (1 holds padding,
  # 2 and 3 a diagonal). CTA 2 (document 5, which no key has): one tile,
  # streamed so that a first step exists, masked to nothing.
  assert [row[:count] for row, count in zip(tiles, (2, 3, 1))] == [[0, 1], [1, 2, 3], [0]]
  assert bounds == [[[0, 2, 2], [1, 2, 2]], [[0, 3, 3], [0, 3, 3]], [[0, 1, 1], [0, 1, 1]]]
  # dK/dV, causal (query tiles per key CTA). CTA 1 (keys 128:256): query
  # tiles 2, 3; warpgroup 1 passes tile 2, all before its keys. CTA 2
  # (document 3, which no query has): one step.
  assert [row[:count] for row, count in zip(key_tiles, (4, 2, 1))] == [
      [0, 1, 2, 3], [2, 3], [0]]
  assert key_bounds == [[[0, 4, 4], [1, 4, 4]], [[0, 2, 2], [1, 2, 2]], [[0, 1, 1]] * 2]

  (tiles, bounds), (key_tiles, key_bounds) = _plans(causal=False)
  # Without causal, CTA 1 (queries 128:256, document 2) sees key tile 1
  # masked, then 2 and 3 whole, unmasked.
  assert tiles[1][:3] == [1, 2, 3] and bounds[1] == [[0, 1, 3], [0, 1, 3]]
  # dK/dV CTA 1 (keys 128:256, document 2): query tiles 1, 2, 3 whole.
  assert key_tiles[1][:3] == [1, 2, 3] and key_bounds[1] == [[0, 0, 3], [0, 0, 3]]


def _random_segments(rng, B: int, L: int, mode: str):
  if mode == "packed":  # ascending documents, trailing padding
    ids = np.sort(rng.randint(1, 6, size=(B, L)), axis=1)
    ids[:, L - rng.randint(0, L // 2 + 1):] = 0
    return ids
  if mode == "blocks":  # runs of 16 positions with ids 0..3
    return np.repeat(rng.randint(0, 4, size=(B, L // 16)), 16, axis=1)
  return rng.randint(0, 3, size=(B, L))


def _check_plan(tiles, bounds, visible_BRX, col_tile: int):
  """Every warpgroup's steps cover each streamed tile in which one of its
  rows sees a position, and its unmasked steps see their whole tile."""
  B, C = tiles.shape[:2]
  for b in range(B):
    for c in range(C):
      for w in range(2):
        first, split, count = bounds[b, c, w]
        listed = tiles[b, c, :count]
        assert len(set(listed.tolist())) == count and 0 <= first < count
        rows = visible_BRX[b, (2 * c + w) * 64:(2 * c + w + 1) * 64]
        block = rows.reshape(64, -1, col_tile).transpose(1, 0, 2)  # [X / col_tile, 64, col_tile]
        needed = {int(n) for n in np.flatnonzero(block.any(axis=(1, 2)))}
        assert needed <= {int(listed[p]) for p in range(first, count)}
        assert all(block[listed[p]].all() for p in range(split, count))


@hypothesis.settings(deadline=None, max_examples=6)
@hypothesis.given(seed=st.integers(0, 2**16), B=st.integers(1, 2), ctas_q=st.integers(1, 3),
                  ctas_k=st.integers(1, 3), block=st.sampled_from([64, 128]),
                  causal=st.booleans(), mode=st.sampled_from(["packed", "blocks", "random"]),
                  window=st.sampled_from([None, 1, 50, 200]))
def test_plans_cover_what_is_visible(seed, B, ctas_q, ctas_k, block, causal, mode, window):
  rng = np.random.RandomState(seed)
  T, S = 128 * ctas_q, 128 * ctas_k
  q_seg = _random_segments(rng, B, T, mode)
  kv_seg = q_seg[:, :S] if S <= T and rng.rand() < 0.5 else _random_segments(rng, B, S, mode)
  visible = (q_seg[:, :, None] == kv_seg[:, None, :]) & (kv_seg[:, None, :] != 0)
  window = window if causal else None
  offset = np.arange(T)[None, :, None] - np.arange(S)[None, None, :]
  if causal:
    visible &= offset >= 0
  if window is not None:
    visible &= offset < window
  cfg = _config(causal, T, block_q_dkv=block, window=window)
  tiles, bounds = (np.asarray(x) for x in hopper._query_plan(q_seg, kv_seg, block, cfg))
  _check_plan(tiles, bounds, visible, block)
  tiles, bounds = (np.asarray(x) for x in hopper._key_plan(q_seg, kv_seg, cfg))
  _check_plan(tiles, bounds, visible.transpose(0, 2, 1), block)


@pytest.mark.parametrize("causal", [False, True])
def test_plan_of_one_document_is_the_static_plan(causal):
  """Segment ids all 1 stream the tiles the kernels stream without segment
  ids; with key tiles of 128 the forward masks the same ones, and the dK/dV
  kernel (query tiles of 64) takes the same steps in the same order, masking
  a tile that either of its warpgroups must mask (one per causal CTA, the
  second warpgroup's diagonal, which the first sees whole)."""
  seg = np.ones((1, 512), np.int32)
  cfg = _config(causal, 512)
  static = dataclasses.replace(cfg, segments=False,
                               blocks=hopper.HopperBlocks(128, 64, 2))
  tiles, bounds = (np.asarray(x)[0] for x in hopper._query_plan(seg, seg, 128, cfg))
  key_tiles, key_bounds = (np.asarray(x)[0] for x in hopper._key_plan(seg, seg, cfg))
  for c in range(4):
    for w in range(2):
      plan = hopper._query_rows_plan(128 * c, w, None, static)
      count, masked = int(plan.count), int(plan.last) - int(plan.whole_to)
      assert bounds[c, w].tolist() == [0, masked, count]
      assert sorted(tiles[c, :count].tolist()) == list(range(count))
      assert tiles[c, :masked].tolist() == list(range(count - masked, count))
      plans = [hopper._key_rows_plan(128 * c, v, None, static) for v in range(2)]
      plan, count, start = plans[w], int(plans[w].count), int(plans[w].start)
      masked_for_either = max(int(p.whole_from) for p in plans) - start
      assert key_bounds[c, w].tolist() == [int(plan.first) - start, masked_for_either, count]
      assert key_tiles[c, :count].tolist() == [int(plan.tile(start + n)) for n in range(count)]


def test_plan_of_the_packed_bench_row():
  """bench/attention.py's `gpt2-small-packed` (documents of 128 to 512
  tokens, causal, S 1024, the default tiles): the tiles streamed per batch
  row, which its docstring quotes, against 36 key tiles (forward) and 72
  query tiles (dK/dV) for causal alone."""
  from bench import attention as bench_attention  # pylint: disable=import-outside-toplevel
  case = dict(B=8, S=1024, D=64)
  seg = bench_attention.segment_ids(case)
  blocks = hopper.choose_hopper_blocks(64, 1024)
  cfg = dataclasses.replace(_config(True, 1024), blocks=blocks)
  _, bounds = hopper._query_plan(seg, seg, blocks.block_k, cfg)
  _, key_bounds = hopper._key_plan(seg, seg, cfg)
  assert np.asarray(bounds)[:, :, 0, 2].sum(axis=1).tolist() == [18, 21, 21, 22, 22, 19, 22, 21]
  assert np.asarray(key_bounds)[:, :, 0, 2].sum(axis=1).tolist() == [
      34, 39, 42, 40, 40, 35, 37, 39]


def test_a_sliding_window_plan_visits_only_its_band():
  """One document of 1,024 tokens, a 100-key window, 64-row tiles: each
  query tile's plan lists the key tiles of its band (its own, and the one
  or two before it that the window reaches), not the causal triangle."""
  seg = np.ones((1, 1024), np.int32)
  cfg = _config(True, 1024, window=100)
  tiles, bounds = (np.asarray(x) for x in hopper._query_plan(seg, seg, 64, cfg))
  counts = bounds[0, :, :, 2].max(axis=1)  # per CTA of two 64-row query tiles
  assert counts.max() <= 4 and counts[-1] == 4  # causal alone: up to 16
