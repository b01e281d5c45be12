"""Synchronisation between the warpgroups of a CTA: hardware named barriers
on the GPU, mbarriers in GPU interpret mode, one protocol for both.

Two uses (FlashAttention-3, Shah et al. 2024, section 3.1):

* ``PingPong``: the two compute warpgroups take turns on the tensor cores.
  A warpgroup issues its matmuls, then ``signal()``s the other one's turn,
  and before its next matmuls ``wait()``s for its own turn (the other's
  signal): one warpgroup's softmax runs while the other's matmuls do.
  ``Meeting`` makes the same calls a meeting of both warpgroups; on an H200
  it was 1-5% faster than the one-way hand-off at D=64 on 9 of 10 shapes,
  even at D=128 and about 1% slower at D=256 (``ForwardConfig.pingpong``,
  ninth session).
* ``Release``: consumers tell the producer that a ring slot is free.

Why named barriers on the GPU: a Mosaic GPU mbarrier arrival is made by every
thread of a warpgroup (128 shared-memory atomics) and a wait spins on
``mbarrier.try_wait``; ``bar.arrive`` / ``bar.sync`` on one of the CTA's 16
hardware barriers is one instruction per warp (tokamax's sm90 attention does
the same). Interpret mode keeps mbarriers with exactly the same arrive /
wait pattern; tests/test_forward_sync.py checks the pattern in each
warpgroup's program order (the interpreter's own phase checks catch a
double signal only when the threads happen to interleave badly).

Barrier ids: Mosaic GPU uses id 0 (``gpu.barrier``) and ids 1..W (one per
warpgroup, ``utils.warpgroup_barrier``; W = 3 with two compute warpgroups
and the producer, 4 with three), so ours start at ``first_turn_id(...)``:
the turns (one id per compute warpgroup), then the ring's releases.
"""

from __future__ import annotations

from jax import lax
import jax.experimental.pallas as pl
import jax.experimental.pallas.mosaic_gpu as plgpu
import jax.numpy as jnp
from jax.experimental.mosaic import gpu as mgpu

WARPGROUP_THREADS = 128
NUM_IDS = 16  # Hardware named barriers per CTA on sm90.


def first_turn_id(compute_warpgroups: int = 2) -> int:
  """The first id free of Mosaic GPU's: 1 (``gpu.barrier``'s 0) plus one per
  warpgroup, the producer included."""
  return compute_warpgroups + 2


def max_ring_slots(compute_warpgroups: int = 2) -> int:
  """Ring slots whose releases fit in the named barriers left after the
  turns (one id per compute warpgroup), two ids per slot: 5 with two
  compute warpgroups, 4 with three."""
  first = first_turn_id(compute_warpgroups) + compute_warpgroups
  return (NUM_IDS - first) // 2


# With two compute warpgroups (the defaults of the classes below).
FIRST_ID = first_turn_id(2)
MAX_RING_SLOTS = max_ring_slots(2)


def release_first_ids(slots: int, compute_warpgroups: int = 2) -> tuple[int, int]:
  """The first named-barrier id of k's and of v's ``slots`` release barriers."""
  first = first_turn_id(compute_warpgroups) + compute_warpgroups
  return first, first + slots


def _bar(op: str, barrier_id, num_threads: int) -> None:
  """``bar.<op> barrier_id, num_threads`` from every thread of the warpgroup
  (the id is a traced int32: the warpgroup's or the ring slot's)."""
  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WG_SPLAT,))
  def emit_dynamic(_, bid):
    mgpu.utils.inline_ptx(f"bar.{op} $0, {num_threads};", bid.registers[()],
                          has_side_effects=True, convergent=True)
  emit_dynamic(jnp.asarray(barrier_id, jnp.int32))


def named_arrive(barrier_id, num_threads: int) -> None:
  """Arrive on hardware barrier ``barrier_id`` (expecting ``num_threads``) without waiting."""
  _bar("arrive", barrier_id, num_threads)


def named_sync(barrier_id, num_threads: int) -> None:
  """Arrive on hardware barrier ``barrier_id`` and wait until ``num_threads`` have."""
  _bar("sync", barrier_id, num_threads)


class PingPong:
  """The compute warpgroups' turns on the tensor cores (FA3 section 3.1).

  Per step each warpgroup calls ``signal()`` once (after issuing its
  matmuls) and ``wait()`` once (before issuing the next ones). The turn
  goes round the warpgroups in order, 0, 1, ..., n - 1, 0, ...: with two the
  ping-pong, with three FlashAttention-3's round robin for head_dim 64 (two
  warpgroups' softmax may then overlap one's matmuls). Every warpgroup but
  0 starts with one extra ``wait()`` (``start``) and every one but the last
  ends with one extra ``signal()`` (``finish``), once per CTA (not per item
  of the persistent kernel), so every signal is waited for before the next
  one on the same barrier: a hardware barrier counts arrivals, and two
  signals in a row would complete it without the waiter.

  Args:
    wg: this warpgroup's index (0 .. num - 1), traced.
    mbarriers: interpret mode: ``plgpu.Barrier(num_barriers=num)`` (one
      warpgroup's arrivals each); None on the GPU, which uses named barriers
      ``first_id + w`` for warpgroup w's turn.
    num: compute warpgroups taking turns (2 or 3).
  """

  def __init__(self, wg, mbarriers=None, first_id: int = FIRST_ID, num: int = 2):
    self.wg = wg
    self.mbarriers = mbarriers
    self.first_id = first_id
    self.num = num

  def signal(self) -> None:
    """Hands the tensor cores to the next warpgroup."""
    nxt = 1 - self.wg if self.num == 2 else lax.rem(self.wg + 1, self.num)
    if self.mbarriers is not None:
      plgpu.barrier_arrive(self.mbarriers.at[nxt])
    else:
      named_arrive(self.first_id + nxt, 2 * WARPGROUP_THREADS)

  def wait(self) -> None:
    """Waits until the previous warpgroup hands the tensor cores on."""
    if self.mbarriers is not None:
      plgpu.barrier_wait(self.mbarriers.at[self.wg])
    else:
      named_sync(self.first_id + self.wg, 2 * WARPGROUP_THREADS)

  def start(self) -> None:
    """Warpgroup 0 goes first; each other one waits for its predecessor."""
    # (With two, the comparison the kernels compiled to before three existed:
    # their SASS stays byte for byte what was timed.)
    pl.when(self.wg == 1 if self.num == 2 else self.wg != 0)(self.wait)

  def finish(self) -> None:
    """Each warpgroup but the last answers its successor's last wait."""
    pl.when(self.wg == 0 if self.num == 2 else self.wg != self.num - 1)(self.signal)


class Meeting(PingPong):
  """``PingPong``'s calls as a meeting: every ``signal()`` and ``wait()``
  waits until both warpgroups have reached the same point (the sixth
  session's ping-pong; ``ForwardConfig(pingpong="meeting")``). The calls
  pair up in the same order as the hand-off's, so the same start / finish
  keep warpgroup 1 half a step behind.

  ``mbarriers``: interpret mode: ``plgpu.Barrier(num_arrivals=2)``, one
  meeting point; None on the GPU, which uses named barrier ``first_id``.
  Two warpgroups only (``ForwardConfig`` checks it).
  """

  def signal(self) -> None:
    if self.mbarriers is not None:
      plgpu.barrier_arrive(self.mbarriers)
      plgpu.barrier_wait(self.mbarriers)
    else:
      named_sync(self.first_id, 2 * WARPGROUP_THREADS)

  wait = signal


class NoTurns:
  """``PingPong``'s interface with no turns (``ForwardConfig(pingpong="off")``)."""

  def __init__(self, wg=None, mbarriers=None, first_id=None, num=None):
    del wg, mbarriers, first_id, num

  def signal(self) -> None:
    pass

  wait = start = finish = signal


# ForwardConfig.pingpong -> the class.
TURNS = {"handoff": PingPong, "meeting": Meeting, "off": NoTurns}


def turn_mbarriers(pingpong: str, compute_warpgroups: int = 2) -> dict | None:
  """The interpret-mode mbarrier the turns need (``plgpu.Barrier``
  arguments; None: none)."""
  return {"handoff": dict(num_barriers=compute_warpgroups),
          "meeting": dict(num_arrivals=2), "off": None}[pingpong]


class Release:
  """Consumers free ring slots for one producer warpgroup.

  Each of ``consumers`` compute warpgroups calls ``free(slot)`` once per
  tile it has finished reading; the producer calls ``wait(slot)`` before it
  overwrites the slot. On the GPU slot ``s`` is named barrier
  ``first_id + s`` counting the consumers' and the producer's threads; in
  interpret mode it is ``mbarriers.at[s]`` (``num_arrivals=consumers``).
  """

  def __init__(self, consumers: int, mbarriers=None, first_id: int = FIRST_ID):
    self.mbarriers = mbarriers
    self.first_id = first_id
    self.threads = (consumers + 1) * WARPGROUP_THREADS

  def free(self, slot) -> None:
    if self.mbarriers is not None:
      plgpu.barrier_arrive(self.mbarriers.at[slot])
    else:
      named_arrive(self.first_id + slot, self.threads)

  def wait(self, slot) -> None:
    if self.mbarriers is not None:
      plgpu.barrier_wait(self.mbarriers.at[slot])
    else:
      named_sync(self.first_id + slot, self.threads)
