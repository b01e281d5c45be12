"""The forward's ping-pong hand-off, checked in each warpgroup's program order.

A hardware named barrier counts arrivals, so a warpgroup must never signal
twice before the other warpgroup's matching wait. The interpreter's phase
checks see that only if the threads happen to interleave badly; this checks
the sufficient, interleaving-free invariant instead: per CTA, warpgroup 0's
turn operations are S W S ... W S and warpgroup 1's W S W ... S W.
"""
import collections
import threading

import jax
import jax.numpy as jnp
import pytest
from jax._src.pallas.mosaic_gpu.interpret import shared_memory as shm

from flash3.kernels.config import ForwardConfig
from flash3.kernels.forward import attention_forward
from flash3.visibility import MaskSpec


@pytest.fixture
def barrier_log(monkeypatch):
  log, lock, serial = [], threading.Lock(), [0]
  init, arrive, wait = shm.Barrier.__init__, shm.Barrier.arrive, shm.Barrier.wait

  def my_init(self, *a, **k):
    init(self, *a, **k)
    with lock:
      self._serial, serial[0] = serial[0], serial[0] + 1

  def who(t):
    return None if t is None else (int(t.block_id), int(t.warpgroup_id))

  def my_arrive(self, thread, *a, **k):
    with lock:
      log.append((self._serial, "S", who(thread)))
    return arrive(self, thread, *a, **k)

  def my_wait(self, thread, *a, **k):
    out = wait(self, thread, *a, **k)
    with lock:
      log.append((self._serial, "W", who(thread)))
    return out

  monkeypatch.setattr(shm.Barrier, "__init__", my_init)
  monkeypatch.setattr(shm.Barrier, "arrive", my_arrive)
  monkeypatch.setattr(shm.Barrier, "wait", my_wait)
  return log


def _turn_sequences(log):
  """{(cta, wg): "SWSW..."} over the turn barriers: arrived at only by one
  compute warpgroup and waited on only by the other."""
  arrivers, waiters = collections.defaultdict(set), collections.defaultdict(set)
  for b, op, t in log:
    if t is not None:
      (arrivers if op == "S" else waiters)[b].add(t[1])
  turn = sorted(b for b, a in arrivers.items()
                if len(a) == 1 and a <= {0, 1} and waiters[b] == {1 - min(a)})
  cta = {b: i // 2 for i, b in enumerate(turn)}  # Allocated in pairs.
  seqs = collections.defaultdict(str)
  for b, op, t in log:
    if b in cta and t is not None:
      seqs[(cta[b], t[1])] += op
  return seqs


CBR = MaskSpec(causal=True, alignment="bottom_right")


@pytest.mark.interpret
@pytest.mark.parametrize("shape,mask,config", [
    ((1, 256, 256, 2, 1), CBR, dict()),
    ((1, 330, 333, 2, 1), CBR, dict(persistent=True, num_sms=3)),
    ((1, 330, 333, 2, 1), CBR, dict(persistent=True, num_sms=2, overlap_softmax=True)),
    ((2, 64, 200, 2, 2), MaskSpec(), dict(persistent=True, num_sms=2, num_stages=1)),
    ((1, 384, 100, 2, 1), MaskSpec(window_left=0, window_right=0),
     dict(persistent=True, num_sms=2)),
    ((1, 330, 333, 2, 1), CBR, dict(epilogue_off_turn=True)),
    ((1, 330, 333, 2, 1), CBR, dict(persistent=True, num_sms=3, epilogue_off_turn=True)),
    ((1, 384, 100, 2, 1), MaskSpec(window_left=0, window_right=0),
     dict(persistent=True, num_sms=2, epilogue_off_turn=True)),
], ids=["grid-causal", "persistent", "persistent-overlap", "persistent-1-stage",
        "persistent-empty-items", "grid-epilogue-off-turn",
        "persistent-epilogue-off-turn", "persistent-empty-items-epilogue-off-turn"])
def test_ping_pong_alternates_in_program_order(barrier_log, shape, mask, config):
  B, Tq, Tk, N, K = shape
  q = jnp.zeros((B, Tq, N, 64), jnp.bfloat16)
  k = jnp.zeros((B, Tk, K, 64), jnp.bfloat16)
  o, _ = attention_forward(q, k, k, scale=0.125, mask=mask, interpret=True,
                           config=ForwardConfig(block_kv=64, pingpong="handoff",
                                                **config))
  o.block_until_ready()
  seqs = _turn_sequences(barrier_log)
  assert seqs
  for (cta, wg), s in seqs.items():
    want = "SW" * (len(s) // 2) + "S" if wg == 0 else "WS" * (len(s) // 2) + "W"
    assert s == want, (cta, wg, s)


@pytest.mark.interpret
@pytest.mark.parametrize("mode", ["off", "meeting"])
@pytest.mark.parametrize("persistent", [False, True])
def test_other_pingpong_modes_take_no_one_way_turns(barrier_log, mode, persistent):
  """ForwardConfig(pingpong="off" / "meeting"): no one-way turn barrier (the
  ring's barriers still run; a meeting's is arrived at by both warpgroups),
  and the output is bitwise the hand-off's: turns order issue, not arithmetic."""
  q = jax.random.normal(jax.random.key(1), (1, 330, 2, 64), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(jax.random.key(2), (1, 333, 1, 64), jnp.float32).astype(jnp.bfloat16)
  config = ForwardConfig(block_kv=64, pingpong=mode, persistent=persistent, num_sms=2)
  o, _ = attention_forward(q, k, k, scale=0.125, mask=CBR, interpret=True, config=config)
  o.block_until_ready()
  assert barrier_log
  assert not _turn_sequences(barrier_log)
  # A meeting barrier: arrived at and waited on by both compute warpgroups
  # (the ring's are waited on by the producer), each arriving then waiting
  # the same number of times (start/finish included: an odd count of pairs).
  arrivers, waiters = collections.defaultdict(set), collections.defaultdict(set)
  for b, op, t in barrier_log:
    if t is not None:
      (arrivers if op == "S" else waiters)[b].add(t[1])
  meetings = [b for b in arrivers if arrivers[b] == waiters[b] == {0, 1}]
  assert bool(meetings) == (mode == "meeting")  # one per CTA
  for b in meetings:
    seqs = collections.defaultdict(str)
    for bb, op, t in barrier_log:
      if bb == b and t is not None:
        seqs[t[1]] += op
    assert seqs[0] == seqs[1] == "SW" * (len(seqs[0]) // 2)
    assert (len(seqs[0]) // 2) % 2 == 1
  on, _ = attention_forward(q, k, k, scale=0.125, mask=CBR, interpret=True,
                            config=ForwardConfig(block_kv=64, pingpong="handoff",
                                                 persistent=persistent, num_sms=2))
  assert jnp.array_equal(o, on)


@pytest.mark.interpret
@pytest.mark.parametrize("persistent", [False, True])
def test_three_warpgroups_pass_the_turn_round_in_order(barrier_log, persistent):
  """ForwardConfig(compute_warpgroups=3): warpgroup w's turn barrier is
  arrived at only by warpgroup w - 1 (mod 3) and waited on only by w, and on
  each one every signal is waited for before the next (S W S W ... in time:
  two signals in a row would complete a hardware barrier without its waiter)."""
  q = jax.random.normal(jax.random.key(1), (1, 400, 2, 64), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(jax.random.key(2), (1, 333, 1, 64), jnp.float32).astype(jnp.bfloat16)
  config = ForwardConfig(block_kv=64, pingpong="handoff", persistent=persistent,
                         num_sms=2, compute_warpgroups=3, compute_registers=160,
                         producer_registers=24)
  o, _ = attention_forward(q, k, k, scale=0.125, mask=CBR, interpret=True, config=config)
  o.block_until_ready()
  arrivers, waiters = collections.defaultdict(set), collections.defaultdict(set)
  for b, op, t in barrier_log:
    if t is not None:
      (arrivers if op == "S" else waiters)[b].add(t[1])
  turn = [b for b in arrivers if len(arrivers[b]) == 1 and arrivers[b] <= {0, 1, 2}
          and waiters[b] == {(min(arrivers[b]) + 1) % 3}]
  # 400 rows in 3 CTAs of 192, times 2 heads; or 2 persistent CTAs.
  ctas = 2 if persistent else 6
  assert len(turn) == 3 * ctas, (len(turn), ctas)
  for b in turn:
    ops = "".join(op for bb, op, t in barrier_log if bb == b and t is not None)
    assert ops == "SW" * (len(ops) // 2) and ops, (b, ops)


@pytest.mark.interpret
@pytest.mark.parametrize("persistent", [False, True])
def test_epilogue_off_turn_adds_one_turn_per_item(barrier_log, persistent):
  """ForwardConfig(epilogue_off_turn=True): per item each warpgroup signals
  and waits once more (around its epilogue), so the turn sequences grow by
  two per item and still alternate."""
  q = jax.random.normal(jax.random.key(1), (1, 330, 2, 64), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(jax.random.key(2), (1, 333, 1, 64), jnp.float32).astype(jnp.bfloat16)
  counts = []
  for off in (False, True):
    barrier_log.clear()
    config = ForwardConfig(block_kv=64, pingpong="handoff", persistent=persistent,
                           num_sms=2, epilogue_off_turn=off)
    attention_forward(q, k, k, scale=0.125, mask=CBR, interpret=True,
                      config=config)[0].block_until_ready()
    seqs = _turn_sequences(barrier_log)
    for (cta, wg), s in seqs.items():
      want = "SW" * (len(s) // 2) + "S" if wg == 0 else "WS" * (len(s) // 2) + "W"
      assert s == want, (off, cta, wg, s)
    counts.append(sum(len(s) for s in seqs.values()))
  # 330 rows: 3 query tiles of 128 rows x 2 heads = 6 items, 2 warpgroups.
  assert counts[1] - counts[0] == 6 * 2 * 2, counts
