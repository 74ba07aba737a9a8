"""The pipeline machinery of the Hopper kernels (`flash_attention_hopper.py`).

A CTA runs three warpgroups: two compute warpgroups, each owning a tile of
`ROWS` rows (the M of one wgmma), and a producer that streams the other
side's tiles with TMA through a ring of `stages` shared-memory slots
(`produce`). Each slot has a "full" barrier (arrived on by its TMA copies)
and a "free" barrier (arrived on by both compute warpgroups when done with
it, `release`); a compute warpgroup that needs fewer tiles than its
neighbour still waits for and frees the rest (`pass_steps`), so the ring
stays in step. The compute warpgroups take turns on the tensor cores
(`Turns`).

A barrier's arrival count is derived from what arrives on it (`filled_by`:
one TMA copy per scratch entry it guards; `each_compute_wg`) and checked at
trace time against the code that arrives (`copy_in`, `release`, `Turns`,
`check_arrivals`): a scratch layout out of step with a kernel is a
ValueError, not a deadlock on the GPU. `scratch_bytes` counts a scratch
list's shared memory as Mosaic GPU allocates it, against
`SHARED_MEMORY_BYTES`.
"""
import math

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from model.kernels import common

ROWS = 64  # rows of a compute warpgroup's tile: the M of one wgmma
COMPUTE_WGS = 2
PRODUCER = COMPUTE_WGS  # index of the producer warpgroup
SHARED_MEMORY_BYTES = 227 * 1024  # the most one CTA may take on an H100/H200


def set_registers(producer: bool):
  """Registers move from the producer (TMA only) to the compute groups."""
  plgpu.set_max_registers(40 if producer else 232,
                          action="decrease" if producer else "increase")


def swizzled_smem(shape, dtype):
  """A shared-memory tile in the 128-byte swizzled layout wgmma reads."""
  return plgpu.SMEM(shape, dtype, transforms=(
      plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
      plgpu.SwizzleTransform(128)))


def produce(num_steps, stages: int, rings):
  """Producer loop over `rings`, pairs (full, free) of barrier arrays with a
  slot per stage, and an `issue(j, slot, barrier)` each: at step j, for each
  ring, wait until slot j % stages is free, then issue the TMA copies of
  step j into it, arriving on its full barrier. At the end it waits for the
  last slots to be freed, so no barrier phase is left unobserved when the
  kernel exits."""
  def wait_free(j, carry):
    for (_, free), _ in rings:
      plgpu.barrier_wait(free.at[lax.rem(j, stages)])
    return carry

  def step(j, carry):
    slot = lax.rem(j, stages)
    for (full, free), issue in rings:
      pl.when(j >= stages)(lambda free=free: plgpu.barrier_wait(free.at[slot]))
      issue(j, slot, full.at[slot])
    return carry
  lax.fori_loop(0, num_steps, step, 0)
  lax.fori_loop(jnp.maximum(num_steps - stages, 0), num_steps, wait_free, 0)


def pass_steps(lo, hi, stages: int, rings, turns=None):
  """Steps [lo, hi) a compute warpgroup does not need: wait for each ring's
  (full, free) slot, then free it (and take and hand back a step's turns, so
  its neighbour is not kept waiting)."""
  def step(j, carry):
    slot = lax.rem(j, stages)
    for full, _ in rings:
      plgpu.barrier_wait(full.at[slot])
    if turns is not None:
      turns.skip_step()
    for _, free in rings:
      release(free.at[slot])
    return carry
  lax.fori_loop(lo, hi, step, 0)


class Turns:
  """Ping-pong of the two compute warpgroups (FlashAttention-3's schedule).

  A warpgroup issues its matmuls only while it holds the turn and hands the
  turn over before its softmax, so one warpgroup's exponentials run while
  the other's matmuls keep the tensor cores busy. Barrier `turn[w]` is
  arrived by the other warpgroup when warpgroup w may go; warpgroup 0 goes
  first. Each step of either warpgroup takes and hands back the turn
  `per_step` times (passed steps too), and both do the same number of steps,
  so the turns stay matched to the end. Disabled, every call is a no-op.
  """

  def __init__(self, turn, enabled: bool, per_step: int):
    if enabled:
      check_arrivals(turn, 1, "the other compute warpgroup")
    self.turn = turn
    self.enabled = enabled
    self.per_step = per_step
    self.wg = lax.axis_index("wg")

  def take(self):
    if self.enabled:
      plgpu.barrier_wait(self.turn.at[self.wg])

  def hand_over(self):
    if self.enabled:
      plgpu.barrier_arrive(self.turn.at[1 - self.wg])

  def skip_step(self):
    for _ in range(self.per_step):
      self.take()
      self.hand_over()

  def start(self):
    """Warpgroup 1 gives warpgroup 0 the first turn."""
    if self.enabled:
      pl.when(self.wg == 1)(lambda: plgpu.barrier_arrive(self.turn.at[0]))

  def finish(self):
    """Warpgroup 0 takes the turn warpgroup 1 handed over last."""
    if self.enabled:
      pl.when(self.wg == 0)(lambda: plgpu.barrier_wait(self.turn.at[0]))


def filled_by(*tiles, num_barriers: int):
  """A barrier arrived on by one TMA copy into each of `tiles`, the scratch
  entries its copies fill (None: absent, no copy)."""
  return plgpu.Barrier(num_arrivals=sum(tile is not None for tile in tiles),
                       num_barriers=num_barriers)


def each_compute_wg(num_barriers: int):
  """A barrier each compute warpgroup arrives on once (`release`,
  `_DqExchange.put`)."""
  return plgpu.Barrier(num_arrivals=COMPUTE_WGS, num_barriers=num_barriers)


def check_arrivals(barrier, count: int, by: str):
  """Raises at trace time unless `barrier` (a ref) counts `count` arrivals:
  its scratch entry and the code arriving on it disagree, which on the GPU
  would deadlock."""
  expected = barrier.dtype.num_arrivals
  if expected != count:
    raise ValueError(f"flash_attention_hopper: a barrier of {expected} arrivals is "
                     f"arrived on by {count} {by}; its scratch entry does not match "
                     "the code that arrives on it")


def copy_in(pairs, barrier):
  """TMA copies of (source in global memory, destination in shared memory)
  pairs, all arriving on `barrier`, which must count one arrival per copy.
  A pair (None, None) is an operand not given; one side None, or shapes that
  differ, is a scratch layout out of step with the kernel: a ValueError."""
  copies = [(src, dst) for src, dst in pairs if src is not None or dst is not None]
  for src, dst in copies:
    if src is None or dst is None or src.shape != dst.shape:
      raise ValueError(f"flash_attention_hopper: a TMA copy from {src} to {dst}: "
                       "the operand and its scratch entry do not match")
  check_arrivals(barrier, len(copies), "TMA copies")
  for src, dst in copies:
    plgpu.copy_gmem_to_smem(src, dst, barrier)


def release(barrier):
  """This compute warpgroup is done with a slot or step: arrive on
  `barrier`, which must count one arrival per compute warpgroup."""
  check_arrivals(barrier, COMPUTE_WGS, "compute warpgroups")
  plgpu.barrier_arrive(barrier)


def at(ref, *index):
  """ref.at[index], or None for an absent operand or scratch entry."""
  return None if ref is None else ref.at[index]


def kernel(name: str, body, out_type, scratch, grid, names, *, interpret: bool):
  """A Mosaic GPU kernel of `COMPUTE_WGS` compute warpgroups and a producer
  (interpreted when `interpret`), named `name`, over `grid` (axes `names`):
  body(operands, outputs, scratch_refs) receives the operands as given,
  outputs as refs in the NamedTuple type of `out_type`, and `scratch` (a
  NamedTuple of scratch types) as a NamedTuple of refs."""
  params = None
  if interpret:
    from jax._src.pallas.mosaic_gpu.interpret import params as gpu_params  # pylint: disable=import-outside-toplevel
    params = gpu_params.InterpretGPUParams()
  mesh = plgpu.Mesh(grid=grid, grid_names=names, num_threads=COMPUTE_WGS + 1,
                    thread_name="wg", kernel_name=name)

  def kernel_body(operands, *outputs):
    pl.run_scoped(lambda refs: body(operands, type(out_type)(*outputs), refs),
                  scratch, collective_axes="wg")
  # pl.kernel rather than plgpu.kernel: it takes a Ref argument (the fused
  # backward's dQ buffer) and aliases it in and out of the kernel.
  return pl.kernel(kernel_body, out_type=out_type, mesh=mesh,
                   compiler_params=plgpu.CompilerParams(approx_math=True),
                   interpret=params, name=mesh.kernel_name)


def turn_barriers(enabled: bool):
  """The two barriers of `Turns` (each arrived on by the other compute
  warpgroup), or None without ping-pong."""
  return plgpu.Barrier(num_arrivals=1, num_barriers=COMPUTE_WGS) if enabled else None


def vectors(n: int, length: int, dtype, present: bool = True):
  """Shared memory for n 1-D tiles (lse, delta, segment ids), or None."""
  return plgpu.SMEM((n, length), dtype) if present else None


def scratch_bytes(scratch) -> int:
  """Shared memory a scratch list takes, as Mosaic GPU allocates it: every
  buffer rounded up to 1 KiB (the alignment of a swizzled tile), 8 bytes a
  barrier; None entries take nothing."""
  size = 0
  for entry in scratch:
    if isinstance(entry, plgpu.Barrier):
      count = entry.num_barriers
      size += 8 * (math.prod(count) if isinstance(count, tuple) else count)
    elif entry is not None:
      size += common.round_up(math.prod(entry.shape) * jnp.dtype(entry.dtype).itemsize, 1024)
  return size
