"""CPU tests of the benchmark suite's pure parts (flash3.bench).

The timing itself (CUPTI) and the real contenders need a Hopper GPU; here the
runner is driven with stand-in contenders and a stand-in clock.
"""

import argparse
import csv
import dataclasses
import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flash3
from flash3._device import hopper_device_kind
from flash3.bench import cases as cases_lib
from flash3.bench import cli
from flash3.bench import flops as flops_lib
from flash3.bench import implementations as impls
from flash3.bench import plots
from flash3.bench import reference
from flash3.bench import report
from flash3.bench import results as results_lib
from flash3.bench import runner
from flash3.bench import timing
from flash3.bench.cases import Case
from flash3.bench.results import Result
from flash3.visibility import MaskSpec, dense_mask


# ----- FLOPs ------------------------------------------------------------------

def test_full_forward_flops_is_4_btt_nd():
  case = Case("t", 2, 128, 96, 4, 2, 64)
  assert flops_lib.forward_flops(case) == 4 * 2 * 128 * 96 * 4 * 64


def test_causal_square_is_exactly_half_and_modes_scale():
  full = Case("t", 2, 512, 512, 16, 16, 128)
  causal = Case("t", 2, 512, 512, 16, 16, 128, causal=True)
  assert flops_lib.forward_flops(causal) == flops_lib.forward_flops(full) / 2
  f = flops_lib.flops(causal, "fwd")
  assert flops_lib.flops(causal, "bwd") == 2.5 * f
  assert flops_lib.flops(causal, "fwd+bwd") == 3.5 * f
  with pytest.raises(ValueError, match="mode"):
    flops_lib.flops(causal, "backward")


@pytest.mark.parametrize("q_len,kv_len", [(37, 37), (20, 53), (53, 20), (1, 9)])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal,window", [
    (True, None), (False, (5, 3)), (True, (7, 0)), (False, (0, 0)),
    (True, (0, 4)), (False, None), (False, (60, 1))])
def test_visible_pairs_equals_dense_count(q_len, kv_len, alignment, causal,
                                          window):
  left, right = window if window else (None, None)
  spec = MaskSpec(causal=causal, alignment=alignment, window_left=left,
                  window_right=right)
  dense = int(np.asarray(dense_mask(spec, q_len, kv_len)).sum())
  assert flops_lib.visible_pairs(q_len, kv_len, spec) == dense


def test_visible_pairs_with_segments_equals_dense_count():
  rng = np.random.default_rng(0)
  for causal in (False, True):
    ids = np.sort(rng.integers(0, 5, size=61)).astype(np.int32)
    spec = MaskSpec(causal=causal, window_left=9)
    dense = dense_mask(spec, 61, 61, query_segment_ids=jnp.asarray(ids)[None],
                       key_value_segment_ids=jnp.asarray(ids)[None])
    assert flops_lib.visible_pairs(61, 61, spec, ids, ids) == int(
        np.asarray(dense).sum())


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal,window,docs", [
    (True, None, False), (False, None, False), (True, (5, 0), False),
    (False, (3, 2), True), (True, None, True)])
def test_visible_pairs_with_lengths_equals_dense_count(alignment, causal,
                                                      window, docs):
  left, right = window if window else (None, None)
  spec = MaskSpec(causal=causal, alignment=alignment, window_left=left,
                  window_right=right)
  ids = np.repeat(np.arange(3, dtype=np.int32), [10, 7, 13]) if docs else None
  for q_len, kv_len in ((30, 30), (30, 30), (17, 30), (30, 17)):
    for q_valid, kv_valid in ((30, 30), (1, 1), (19, 19), (12, 25),
                              (25, 12), (None, 9), (6, None), (0, 5)):
      qv = None if q_valid is None else min(q_valid, q_len)
      kv = None if kv_valid is None else min(kv_valid, kv_len)
      seg = ({} if ids is None or q_len != kv_len else
             dict(query_segment_ids=jnp.asarray(ids)[None],
                  key_value_segment_ids=jnp.asarray(ids)[None]))
      dense = dense_mask(
          spec, q_len, kv_len,
          query_seq_lengths=None if qv is None else jnp.array([qv]),
          key_value_seq_lengths=None if kv is None else jnp.array([kv]),
          **seg)
      got = flops_lib.visible_pairs(
          q_len, kv_len, spec, *([ids, ids] if seg else [None, None]),
          q_valid=qv, kv_valid=kv)
      assert got == int(np.asarray(dense).sum()), (q_len, kv_len, qv, kv)
  with pytest.raises(ValueError, match="q_valid"):
    flops_lib.visible_pairs(8, 8, spec, q_valid=9)


def test_padding_lengths_count_exactly():
  # Causal rows of valid length L see L(L+1)/2 pairs: exact, not L^2/2.
  case = cases_lib.suite_cases("masks")[-1]
  pairs = sum(n * (n + 1) // 2 for n in (4096, 3072, 2048, 1024))
  assert flops_lib.forward_flops(case) == 4 * 16 * 128 * pairs
  full = Case("m", 2, 64, 64, 2, 2, 32, seq_lengths=(64, 10))
  assert flops_lib.forward_flops(full) == 4 * 2 * 32 * (64**2 + 10**2)
  # Each row counted with its own lengths and documents.
  both = Case("m", 2, 12, 12, 1, 1, 8, causal=True, num_docs=3,
              seq_lengths=(12, 6))
  ids = jnp.asarray(both.segment_ids())
  dense = dense_mask(both.mask_spec, 12, 12,
                     query_seq_lengths=jnp.asarray(both.lengths()),
                     key_value_seq_lengths=jnp.asarray(both.lengths()),
                     query_segment_ids=ids, key_value_segment_ids=ids)
  assert flops_lib.forward_flops(both) == 4 * 8 * int(np.asarray(dense).sum())


def test_visible_pairs_rejects_bad_segments():
  ids = np.arange(8)
  with pytest.raises(ValueError, match="both"):
    flops_lib.visible_pairs(8, 8, MaskSpec(), ids, None)
  with pytest.raises(ValueError, match="non-decreasing"):
    flops_lib.visible_pairs(8, 8, MaskSpec(), ids, ids[::-1].copy())


def test_window_and_packed_documents_count_exactly():
  window = Case("m", 1, 16384, 16384, 16, 16, 128, causal=True,
                window=(1024, 0))
  pairs = 1024 * 1025 // 2 + (16384 - 1024) * 1025  # Row i sees min(i,1024)+1.
  assert flops_lib.forward_flops(window) == 4 * 16 * 128 * pairs
  docs = Case("m", 2, 16384, 16384, 16, 16, 128, causal=True, num_docs=8)
  assert flops_lib.forward_flops(docs) == 4 * 2 * 16 * 128 * 8 * (
      2048 * 2049 // 2)
  docs_full = Case("m", 1, 16384, 16384, 16, 16, 128, num_docs=8)
  assert flops_lib.forward_flops(docs_full) == 4 * 16 * 128 * 8 * 2048**2


def test_tflops_per_s():
  assert flops_lib.tflops_per_s(2e12, 4.0) == pytest.approx(500.0)
  assert flops_lib.tflops_per_s(1e12, None) is None
  assert flops_lib.tflops_per_s(1e12, 0.0) is None


# ----- suites -----------------------------------------------------------------

def test_fa3_grid_shapes():
  grid = cases_lib.suite_cases("fa3")
  assert len(grid) == 2 * 3 * 2 * 6
  assert {c.q_len for c in grid} == {512, 1024, 2048, 4096, 8192, 16384}
  assert {c.head_dim for c in grid} == {64, 128, 256}
  assert {c.dtype for c in grid} == {"float16", "bfloat16"}
  assert {c.causal for c in grid} == {False, True}
  for c in grid:
    assert c.batch * c.q_len == 16384 and c.num_heads * c.head_dim == 2048
    assert c.q_len == c.kv_len and c.num_heads == c.num_kv_heads


def test_other_suites():
  gqa = cases_lib.suite_cases("gqa")
  assert {(c.num_heads, c.num_kv_heads, c.head_dim) for c in gqa} == {
      (32, 8, 128)}
  assert max(c.q_len for c in cases_lib.suite_cases("long")) == 131072
  masks = cases_lib.suite_cases("masks")
  assert [c.mask for c in masks] == [
      "causal", "causal+window(1024,0)", "docs8", "causal+docs8",
      "causal+lens(4096,3072,2048,1024)"]
  assert all(c.batch * c.q_len == 16384 for c in masks)
  padded = masks[-1]
  assert (padded.batch, padded.q_len, padded.kv_len) == (4, 4096, 4096)
  assert (padded.num_heads, padded.head_dim, padded.dtype) == (16, 128,
                                                               "bfloat16")
  assert padded.seq_lengths == (4096, 3072, 2048, 1024) and padded.causal
  assert padded.label() == ("B=4 Tq=4096 Tk=4096 N=16 K=16 D=128 bfloat16 "
                            "causal+lens(4096,3072,2048,1024)")
  # Smaller rows: the padding case keeps B*T and repeats its lengths.
  small = cases_lib.masks_suite(seq_len=4096)[-1]
  assert (small.batch, small.q_len) == (16, 1024)
  assert small.seq_lengths == (1024, 768, 512, 256) * 4
  quick = cases_lib.suite_cases("quick")
  assert 1 <= len(quick) <= 4 and {c.dtype for c in quick} == {"float16"}
  every = cases_lib.suite_cases("all", ["bfloat16"])
  assert len(every) == sum(len(cases_lib.suite_cases(n, ["bfloat16"]))
                           for n in cases_lib.FULL)
  assert {c.dtype for c in every} == {"bfloat16"}
  with pytest.raises(ValueError, match="unknown suite"):
    cases_lib.suite_cases("nope")


def test_case_segment_ids_and_validation():
  seg = Case("m", 2, 12, 12, 2, 2, 64, num_docs=3).segment_ids()
  assert seg.shape == (2, 12) and seg.dtype == np.int32
  assert seg[1].tolist() == [0] * 4 + [1] * 4 + [2] * 4
  assert Case("m", 1, 8, 8, 2, 2, 64).segment_ids() is None
  with pytest.raises(ValueError, match="num_kv_heads"):
    Case("m", 1, 8, 8, 6, 4, 64)
  with pytest.raises(ValueError, match="num_docs"):
    Case("m", 1, 10, 10, 2, 2, 64, num_docs=3)
  with pytest.raises(ValueError, match="dtype"):
    Case("m", 1, 8, 8, 2, 2, 64, dtype="float32")


def test_case_seq_lengths_and_validation():
  case = Case("m", 3, 16, 16, 2, 2, 64, causal=True, seq_lengths=[16, 9, 1])
  assert case.seq_lengths == (16, 9, 1)  # Stored as a tuple: hashable.
  assert hash(case) == hash(dataclasses.replace(case))
  lens = case.lengths()
  assert lens.dtype == np.int32 and lens.tolist() == [16, 9, 1]
  assert case.mask == "causal+lens(16,9,1)"
  assert Case("m", 1, 8, 8, 2, 2, 64).lengths() is None
  many = Case("m", 6, 8, 8, 2, 2, 64, seq_lengths=(8, 7, 6, 5, 4, 3))
  assert many.mask == "lens(3..8,sum=33)"
  both = Case("m", 2, 12, 12, 2, 2, 64, num_docs=3, seq_lengths=(12, 5))
  assert both.mask == "docs3+lens(12,5)"
  for bad, match in (((8, 8), "2 values for batch=3"),
                     ((8, 0, 8), r"\[1, 8\], not \[0\]"),
                     ((8, 9, 8), r"not \[9\]"),
                     (("a", 1, 1), "tuple of ints")):
    with pytest.raises(ValueError, match="seq_lengths") as e:
      Case("m", 3, 8, 8, 2, 2, 64, seq_lengths=bad)
    assert e.match(match)
  with pytest.raises(ValueError, match="seq_lengths needs q_len == kv_len"):
    Case("m", 1, 8, 16, 2, 2, 64, seq_lengths=(8,))


def _ids(cases):
  return [(c.suite, c.label()) for c in cases]


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 7])
def test_shards_partition_a_suite_in_its_order(count):
  cases = cases_lib.suite_cases("all", ["float16", "bfloat16"])
  shards = [cases_lib.shard(cases, i, count) for i in range(count)]
  together = [c for s in shards for c in s]
  assert sorted(_ids(together)) == sorted(_ids(cases))  # Each case once.
  assert max(map(len, shards)) - min(map(len, shards)) <= 1
  position = {c: i for i, c in enumerate(_ids(cases))}
  for s in shards:  # The suite's order within a shard.
    assert [position[c] for c in _ids(s)] == sorted(position[c]
                                                    for c in _ids(s))


@pytest.mark.parametrize("count", [2, 4])
def test_fa3_shards_get_the_same_mix_of_lengths_dims_and_dtypes(count):
  cases = cases_lib.suite_cases("fa3", ["float16", "bfloat16"])
  assert len(cases) == 72
  costs = []
  for i in range(count):
    s = cases_lib.shard(cases, i, count)
    assert len(s) == 72 // count
    for t in (512, 1024, 2048, 4096, 8192, 16384):
      assert sum(c.q_len == t for c in s) == 12 // count
    for d in (64, 128, 256):
      assert sum(c.head_dim == d for c in s) == 24 // count
    assert sum(c.dtype == "float16" for c in s) == 36 // count
    assert sum(c.causal for c in s) == 36 // count
    costs.append(sum(map(cases_lib.estimated_cost, s)))
  assert max(costs) / min(costs) < 1.02


def test_shard_rejects_bad_indices():
  cases = cases_lib.suite_cases("gqa")
  for index, count in ((2, 2), (-1, 2), (0, 0)):
    with pytest.raises(ValueError, match="0 <= index < count"):
      cases_lib.shard(cases, index, count)


def test_float16_and_long_cases_cost_more():
  small = Case("t", 32, 512, 512, 16, 16, 128, "bfloat16")
  assert cases_lib.estimated_cost(small) == pytest.approx(1.0, abs=0.01)
  assert cases_lib.estimated_cost(
      dataclasses.replace(small, dtype="float16")) > 1.3
  long = Case("t", 1, 131072, 131072, 16, 16, 128, "bfloat16")
  assert cases_lib.estimated_cost(long) > 5


# ----- command line -----------------------------------------------------------

def test_parse_shape():
  assert cli.parse_shape("B=2,T=4096,N=32,K=8,D=128") == dict(
      B=2, T=4096, Tq=4096, Tk=4096, N=32, K=8, D=128)
  assert cli.parse_shape("B=1,Tq=10,Tk=30,N=4,D=64")["K"] == 4
  for bad in ("B=2,T=4096,N=32", "B=2,T=x,N=1,D=64", "Q=1,B=1,T=1,N=1,D=64",
              "B2"):
    with pytest.raises(Exception) as e:
      cli.parse_shape(bad)
    assert "shape" in str(e.value)


@pytest.mark.parametrize("text,message", [
    ("B=2,T=64,N=1,D=64,B=3", "gives B twice"),
    ("B=1,T=64,Tq=32,N=1,D=64", "gives T and Tq;"),
    ("B=1,T=64,Tk=32,N=1,D=64", "gives T and Tk;"),
])
def test_parse_shape_refuses_repeated_or_ambiguous_lengths(text, message):
  with pytest.raises(argparse.ArgumentTypeError, match=message) as e:
    cli.parse_shape(text)
  assert text in str(e.value)


@pytest.mark.parametrize("argv,flags", [
    (["--seqlens", "999"], "--seqlens"), (["--head-dims", "128"], "--head-dims"),
    (["--suite", "long"], "--suite"), (["--quick"], "--quick"),
    (["--suite", "fa3", "--seqlens", "64"], "--suite and --seqlens")])
def test_shape_refuses_the_suite_flags_it_would_ignore(argv, flags, capsys):
  assert cli.main(["--list", "--shape", "B=1,T=64,N=1,D=64"] + argv) == 2
  err = _one_error_line(capsys)
  assert err.startswith("flash3-bench: --shape runs its one shape")
  assert f"drop {flags} (or --shape)" in err


def test_shape_cases_are_sharded_by_dtype(capsys):
  """--shard deals --shape's cases (one per dtype) out like a suite's."""
  shape = ["--shape", "B=1,T=64,N=1,D=64", "--dtypes", "float16,bfloat16"]
  shards = [cli.select_cases(cli.parse(shape + ["--shard", f"{i}/2"]))
            for i in range(2)]
  assert [len(s) for s in shards] == [1, 1]
  assert {shards[0][0].dtype, shards[1][0].dtype} == {"float16", "bfloat16"}
  assert cli.select_cases(cli.parse(shape[:2] + ["--shard", "1/2"])) == []


def test_parse_defaults_and_quick():
  args = cli.parse([])
  assert args.suite is None and args.iterations == 10 and not args.no_tune
  assert {c.suite for c in cli.select_cases(args)} == {"fa3"}  # The default.
  assert args.modes == ("fwd", "fwd+bwd") and args.out == "bench-results"
  assert args.compile_jobs == 8 and runner.Options().compile_jobs == 8
  assert cli.parse(["--compile-jobs", "1"]).compile_jobs == 1
  quick = cli.parse(["--quick"])
  assert quick.iterations == cli.QUICK_ITERATIONS and quick.no_tune
  args = cli.parse(["--shape", "B=1,T=256,N=4,D=64", "--window", "16,0",
                    "--docs", "2", "--causal", "--dtypes", "float16,bfloat16",
                    "--impls", "cudnn,flash3", "--modes", "fwd"])
  selected = cli.select_cases(args)
  assert [c.dtype for c in selected] == ["float16", "bfloat16"]
  assert selected[0].mask == "causal+window(16,0)+docs2"
  assert args.impls == ("cudnn", "flash3") and args.modes == ("fwd",)
  # One int W is the window (W, W), as jax.nn's local_window_size takes it.
  (case,) = cli.select_cases(cli.parse(["--shape", "B=1,T=256,N=4,D=64",
                                        "--window", "5"]))
  assert case.window == (5, 5) and case.mask == "window(5,5)"


def test_lengths_flag():
  args = cli.parse(["--shape", "B=3,T=128,N=4,D=64", "--causal", "--lengths",
                    "128,64,1"])
  (case,) = cli.select_cases(args)
  assert case.seq_lengths == (128, 64, 1) and case.causal
  assert case.mask == "causal+lens(128,64,1)"
  for lengths, match in (("128,64", "2 values for batch=3"),
                         ("128,64,129", "129")):
    with pytest.raises(ValueError, match="--lengths: seq_lengths") as e:
      cli.select_cases(cli.parse(["--shape", "B=3,T=128,N=4,D=64",
                                  "--lengths", lengths]))
    assert e.match(match)
  with pytest.raises(ValueError, match="q_len == kv_len"):
    cli.select_cases(cli.parse(["--shape", "B=1,Tq=64,Tk=128,N=4,D=64",
                                "--lengths", "64"]))
  with pytest.raises(ValueError, match="--lengths go with --shape"):
    cli.select_cases(cli.parse(["--lengths", "64"]))


@pytest.mark.parametrize("argv,message", [
    (["--lengths", "64,x"], "comma-separated ints"),
    (["--lengths", "64,0"], ">= 1"),
    (["--lengths", ""], "comma-separated ints"),
])
def test_bad_lengths_exit_2(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["--list", "--shape", "B=2,T=64,N=4,D=64"] + argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--shape", "B=2,T=64,N=4,D=64", "--lengths", "64"], "1 values"),
    (["--shape", "B=1,T=64,N=4,D=64", "--lengths", "65"], "[1, 64]"),
    (["--lengths", "64"], "--shape"),
])
def test_lengths_that_do_not_fit_return_2(argv, message, capsys):
  assert cli.main(["--list"] + argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("flash3-bench: ") and message in err
  assert "Traceback" not in err


def test_seqlens_and_head_dims_filter_a_suite():
  args = cli.parse(["--suite", "fa3", "--seqlens", "4096,16384", "--head-dims", "128",
                    "--dtypes", "bfloat16"])
  selected = cli.select_cases(args)
  assert {(c.q_len, c.head_dim) for c in selected} == {(4096, 128), (16384, 128)}
  assert len(selected) == 4  # causal and not
  with pytest.raises(ValueError, match="leave no case"):
    cli.select_cases(cli.parse(["--seqlens", "7"]))


@pytest.mark.parametrize("argv", [["--dtypes", "float32"], ["--modes", "bwd"],
                                  ["--window", "1,2,3"], ["--window", "a"],
                                  ["--iterations", "0"],
                                  ["--suite", "nope"],
                                  ["--list", "--shape", "B=2,T=64,N=4,D=64", "--docs", "0"],
                                  ["--list", "--shard", "2/2"],
                                  ["--list", "--shard", "1"],
                                  ["--list", "--shard", "0/0"],
                                  ["--list", "--compile-jobs", "0"],
                                  ["--list", "--compile-jobs", "two"],
                                  ["--list", "--interleave", "-1"],
                                  ["--list", "--interleave", "3", "--compile-jobs", "1"],
                                  ["--list", "--interleave", "11"]])
def test_bad_arguments_exit_2(argv, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(argv)
  assert e.value.code == 2
  assert "flash3-bench" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["--window", "-1,0"], "--window '-1,0': must be >= 0"),
    (["--window", "-3"], "--window '-3': must be >= 0"),
    (["--lengths", "-1,64"], "--lengths '-1,64': must be >= 1")])
def test_a_negative_list_value_gets_its_own_error(argv, message, capsys):
  """argparse took "-1,0" for an option: "expected one argument"."""
  with pytest.raises(SystemExit) as e:
    cli.main(["--list", "--shape", "B=1,T=64,N=1,D=64"] + argv)
  assert e.value.code == 2
  assert message in capsys.readouterr().err


def test_negative_list_values_are_joined_only_after_their_options():
  assert cli._join_negative_lists(["--seqlens", "-1,2", "--window", "1,0"]) == [
      "--seqlens=-1,2", "--window", "1,0"]
  assert cli._join_negative_lists(["--shape", "-1,0"]) == ["--shape", "-1,0"]
  assert cli._join_negative_lists(["--window", "-x"]) == ["--window", "-x"]


@pytest.mark.parametrize("budget", ["0", "-5", "nan", "soon"])
def test_a_time_budget_of_no_time_exits_2(budget, capsys):
  """0 or less ran no case, wrote empty results and exited 0."""
  with pytest.raises(SystemExit) as e:
    cli.main(["--list", "--time-budget", budget])
  assert e.value.code == 2
  assert (f"argument --time-budget: {budget!r}: expected a number of seconds > 0"
          in capsys.readouterr().err)
  assert cli.parse(["--time-budget", "0.5"]).time_budget == 0.5


@pytest.mark.parametrize("argv", [["--list", "--impls", "bogus"],
                                  ["--replot", "/nonexistent.json"],
                                  ["--replot", "README.md"],
                                  ["--merge", "docs/benchmarks/h200", "/nonexistent"],
                                  ["--list", "--skip-done", "/nonexistent"],
                                  # Head dims flash3 does not take.
                                  ["--list", "--shape", "B=2,T=64,N=4,K=2,D=512"],
                                  ["--list", "--shape", "B=2,T=64,N=4,D=12"],
                                  ["--list", "--quick", "--suite", "long"]])
def test_bad_inputs_return_2_with_one_line(argv, capsys):
  assert cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith("flash3-bench:") and "Traceback" not in err


def test_list_runs_without_gpu(capsys):
  assert cli.main(["--list", "--suite", "gqa"]) == 0
  out = capsys.readouterr().out
  assert "N=32 K=8 D=128" in out and out.strip().endswith("10 cases x 2 modes")


def test_merge_of_a_json_that_is_not_results_says_so(tmp_path, capsys):
  bad = tmp_path / "bad.json"
  bad.write_text("{}")
  assert cli.main(["--merge", str(bad), "--out", str(tmp_path / "out")]) == 2
  err = capsys.readouterr().err.strip()
  assert err.endswith("not a flash3-bench results.json (no 'environment' field)")
  assert len(err.splitlines()) == 1


def test_list_shows_the_configs_flash3_picks(capsys):
  from flash3.kernels.backward import BackwardConfig
  from flash3.kernels.config import forward_config
  from flash3.visibility import MaskSpec
  assert cli.main(["--list", "--shape", "B=32,T=512,N=16,D=128", "--causal",
                   "--dtypes", "bfloat16"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[1].startswith("       flash3: fwd ForwardConfig(")
  spec = MaskSpec(causal=True)
  fwd = forward_config(128, jnp.bfloat16, spec, 512, 512)
  bwd = BackwardConfig.heuristic(128, 512, 512, spec)
  assert fwd.persistent and bwd.reverse_q_tiles  # What the H200 sweeps chose.
  assert lines[1].strip() == f"flash3: fwd {fwd}; bwd {bwd}"
  # D=96 is padded to 128 by the kernels: the configs are those of D=128.
  assert cli.main(["--list", "--shape", "B=1,T=512,N=4,D=96", "--impls",
                   "flash3"]) == 0
  assert "fwd ForwardConfig(" in capsys.readouterr().out
  assert cli.main(["--list", "--shape", "B=1,T=512,N=4,D=96", "--impls",
                   "cudnn"]) == 0
  assert "flash3:" not in capsys.readouterr().out


def test_list_one_shard(capsys):
  assert cli.main(["--list", "--suite", "fa3", "--dtypes", "float16,bfloat16",
                   "--shard", "1/4"]) == 0
  lines = [l for l in capsys.readouterr().out.strip().splitlines()
           if not l.startswith(" ")]  # Indented: flash3's configs of a case.
  assert lines[-1] == "18 cases x 2 modes (shard 1/4)"
  listed = [l.split(None, 1)[1] for l in lines[:-1]]
  expected = cases_lib.shard(cases_lib.suite_cases(
      "fa3", ["float16", "bfloat16"]), 1, 4)
  assert listed == [c.label() for c in expected]


def test_an_empty_shard_runs_nothing_and_says_so(capsys, tmp_path):
  assert cli.main(["--suite", "quick", "--shard", "6/8", "--out",
                   str(tmp_path / "out")]) == 0
  assert "shard 6/8 has no case" in capsys.readouterr().err
  assert not (tmp_path / "out").exists()


def _one_error_line(capsys) -> str:
  err = capsys.readouterr().err
  assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
  return err


def _an_out_that_cannot_be(kind, tmp_path) -> str:
  (tmp_path / "afile").write_text("")
  return {"file": str(tmp_path / "afile"),
          "under a file": str(tmp_path / "afile" / "sub"),
          "uncreatable": "/proc/nope"}[kind]


@pytest.mark.parametrize("kind,message", [
    ("file", "afile is a file"), ("under a file", "is under"),
    ("uncreatable", "cannot create the directory")])
def test_replot_into_an_out_that_cannot_be_a_directory_returns_2(kind, message,
                                                                 tmp_path, capsys):
  out = _an_out_that_cannot_be(kind, tmp_path)
  results = "docs/benchmarks/h200/2026-12-04-s26/call9/bench/results.json"
  assert cli.main(["--replot", results, "--out", out, "--no-plots"]) == 2
  err = _one_error_line(capsys)
  assert err.startswith(f"flash3-bench: --out {out}") and message in err


@pytest.mark.parametrize("kind", ["file", "under a file", "uncreatable"])
def test_a_run_into_a_bad_out_returns_2_before_any_case(kind, tmp_path, capsys,
                                                        monkeypatch):
  out = _an_out_that_cannot_be(kind, tmp_path)
  monkeypatch.setattr(cli, "hopper_problem", lambda: None)  # As on an H200.
  def fail(*args, **kwargs):
    raise AssertionError("a case ran")
  monkeypatch.setattr(runner, "run", fail)
  assert cli.main(["--shape", "B=1,T=64,N=1,D=64", "--out", out]) == 2
  assert _one_error_line(capsys).startswith(f"flash3-bench: --out {out}")


def test_an_unwritable_out_returns_2(tmp_path, capsys, monkeypatch):
  access = cli.os.access  # Stands in for a read-only directory (root writes anywhere).
  monkeypatch.setattr(cli.os, "access",
                      lambda path, mode: path != str(tmp_path) and access(path, mode))
  results = "docs/benchmarks/h200/2026-12-04-s26/call9/bench/results.json"
  assert cli.main(["--replot", results, "--out", str(tmp_path)]) == 2
  assert "is not writable" in _one_error_line(capsys)


def test_mask_flags_need_shape(capsys):
  assert cli.main(["--causal", "--list"]) == 2
  assert "--shape" in capsys.readouterr().err


def test_unknown_impl_exits_2(capsys):
  assert cli.main(["--quick", "--impls", "flash3,nope"]) == 2
  assert "nope" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.serial  # Asserts a CUPTI throughput: not with other processes on the GPU.
def test_one_small_shape_end_to_end_on_hopper(tmp_path):
  out = tmp_path / "out"
  assert cli.main(["--shape", "B=1,T=512,N=2,D=64", "--dtypes", "float16",
                   "--iterations", "2", "--no-progress", "--out",
                   str(out)]) == 0
  _, rows = report.read_json(out / "results.json")
  cudnn = {r.mode: r for r in rows if r.impl == "cudnn"}
  assert cudnn["fwd"].status == "ok" and cudnn["fwd"].tflops > 1
  assert cudnn["fwd"].check_ratio <= 1.0 and len(cudnn["fwd"].times_ms) == 2
  assert {r.impl for r in rows} == {i.name for i in impls.select(None)}
  assert (out / "plots" / "single_float16_fwd.png").exists()


@pytest.mark.skipif(hopper_device_kind() is not None,
                    reason="tests the path without a Hopper GPU")
def test_without_hopper_one_line_and_nonzero(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "flash3.bench", "--quick", "--out",
       str(tmp_path)], capture_output=True, text=True, timeout=300)
  assert proc.returncode == 1
  assert proc.stdout == ""
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("flash3-bench: cannot run")
  assert "Traceback" not in proc.stderr
  assert not any(tmp_path.iterdir())


def test_import_flash3_needs_no_matplotlib_or_tqdm():
  code = ("import sys, flash3, flash3.bench, flash3.bench.cli, "
          "flash3.bench.report, flash3.bench.plots, flash3.bench.runner\n"
          "assert 'matplotlib' not in sys.modules, 'matplotlib'\n"
          "assert 'tqdm' not in sys.modules, 'tqdm'\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr


# ----- results, table, files, plots -------------------------------------------

def _row(impl, mode, t, ms, status="ok", d=128, mask="causal", suite="fa3"):
  case = Case(suite, 16384 // t, t, t, 2048 // d, 2048 // d, d, "float16",
              causal=mask == "causal")
  r = Result.for_case(case, impl, mode, status)
  if status == "ok":
    r.median_ms, r.min_ms, r.max_ms = ms, ms * 0.99, ms * 1.02
    r.times_ms = [ms * 0.99, ms, ms * 1.02]
    r.tflops = flops_lib.tflops_per_s(r.flops, ms)
  else:
    r.reason = "NotImplementedError: no causal backward"
  return r


def synthetic_results():
  rows = []
  for t in (1024, 4096):
    for mask in ("full", "causal"):
      rows += [_row("cudnn", "fwd", t, 1.0, mask=mask),
               _row("cudnn", "fwd+bwd", t, 3.0, mask=mask),
               _row("flash3", "fwd", t, 0.8, mask=mask),
               _row("flash3", "fwd+bwd", t, 2.8, mask=mask),
               _row("jax-mgpu", "fwd", t, 1.25, mask=mask),
               _row("jax-mgpu", "fwd+bwd", t, None, status="unsupported",
                    mask=mask)]
  rows += results_lib.derive_backward(rows)
  results_lib.add_ratios(rows, "cudnn")
  return rows


def test_derived_backward_and_ratios():
  rows = synthetic_results()
  bwd = {(r.impl, r.q_len, r.mask): r for r in rows if r.mode == "bwd"}
  b = bwd[("flash3", 4096, "causal")]
  assert b.status == "ok" and b.median_ms == pytest.approx(2.0)
  fwd = next(r for r in rows if (r.impl, r.mode, r.q_len, r.mask)
             == ("flash3", "fwd", 4096, "causal"))
  assert b.flops == pytest.approx(2.5 * fwd.flops)
  assert b.tflops == pytest.approx(b.flops / 2e-3 / 1e12)
  assert bwd[("jax-mgpu", 4096, "causal")].status == "unsupported"
  assert fwd.ratio_to_baseline == pytest.approx(1.25)
  assert b.ratio_to_baseline == pytest.approx(2.0 / 2.0)
  mgpu = next(r for r in rows if r.impl == "jax-mgpu" and r.mode == "fwd")
  assert mgpu.ratio_to_baseline == pytest.approx(0.8)


def test_table_lists_numbers_and_reasons():
  rows = sorted(synthetic_results(), key=report.sort_key)
  text = report.table(rows)
  lines = text.splitlines()
  assert lines[0].split()[:3] == ["suite", "dtype", "B"]
  assert "vs cudnn" in lines[0] and len(lines) == 2 + len(rows)
  flash = next(l for l in lines if " flash3 " in l and " fwd " in l
               and " 4096 " in l and "causal" in l)
  cells = flash.split()
  assert "1.25" in cells and "0.800" in cells and "3.0%" in cells
  assert any("unsupported: NotImplementedError" in l for l in lines)


def test_markdown_summary():
  text = report.markdown(synthetic_results())
  lines = text.splitlines()
  assert lines[0].startswith("| suite | dtype | D | N/K | T | mask | mode | "
                             "flash3 TFLOP/s | cudnn TFLOP/s | jax-mgpu")
  assert lines[0].endswith("flash3/cudnn |")
  assert len(lines) == 2 + 2 * 2 * 3  # (T, mask) x (fwd, fwd+bwd, bwd).
  row = next(l for l in lines if "| 4096 | causal | fwd+bwd |" in l)
  cells = [c.strip() for c in row.strip("|").split("|")]
  assert cells[-1] == "1.07" and cells[-2] == "-"  # jax-mgpu unsupported.


def test_headline_gives_geometric_means_and_wins():
  rows = []
  for d in (64, 128):
    for t in (1024, 4096):
      slow = d == 64 and t == 1024  # flash3 behind jax-mgpu on this one case.
      rows += [_row("cudnn", "fwd", t, 1.0, d=d), _row("cudnn", "fwd+bwd", t, 3.0, d=d),
               _row("flash3", "fwd", t, 1.6 if slow else 0.5, d=d),
               _row("flash3", "fwd+bwd", t, 2.5, d=d),
               _row("jax-mgpu", "fwd", t, 1.25, d=d),
               _row("jax-mgpu", "fwd+bwd", t, None, status="unsupported", d=d)]
  rows += results_lib.derive_backward(rows)
  results_lib.add_ratios(rows, "cudnn")
  lines = report.headline(rows).splitlines()
  assert lines[2] == "| suite | dtype | D | mode | flash3/cudnn | jax-mgpu/cudnn |"

  def row(dtype, d, mode):
    return next(l for l in lines if l.startswith(f"| fa3 | {dtype} | {d} | {mode} |"))
  # D=64 forward: ratios 1/1.6 and 2; geometric mean sqrt(1.25).
  assert row("float16", 64, "fwd") == ("| fa3 | float16 | 64 | fwd | 1.12 (0.62-2.00; 2)"
                                       " | 0.80 (0.80-0.80; 2) |")
  # Over the suite (two head dims): ratios 0.625, 2, 2, 2.
  assert row("all", "all", "fwd").split(" | ")[4] == "1.50 (0.62-2.00; 4)"
  # Backward = (fwd+bwd) - fwd: 2.0 ms like cuDNN, 0.9 ms on the slow case.
  assert row("all", "all", "bwd").split(" | ")[4:] == ["1.22 (1.00-2.22; 4)", "- |"]
  assert "- fa3 fwd: 3 of 4 cases" in lines
  assert "- fa3 fwd+bwd: 4 of 4 cases" in lines
  # One (dtype, D) per suite: no "all" rows; nothing ran: no headline.
  one = [r for r in rows if r.head_dim == 128]
  assert "| all |" not in report.headline(one)
  assert report.headline([r for r in rows if r.status != "ok"]) == ""


def test_headline_wins_do_not_count_the_subjects_own_variants():
  # flash3-nondet, faster than flash3 on every case, is no rival of flash3's;
  # cudnn-det, slower, is.
  rows = []
  for t in (1024, 4096):
    rows += [_row("cudnn", "fwd", t, 1.0), _row("flash3", "fwd", t, 0.9),
             _row("flash3-nondet", "fwd", t, 0.5), _row("cudnn-det", "fwd", t, 1.2)]
  results_lib.add_ratios(rows, "cudnn")
  text = report.headline(rows)
  assert "- fa3 fwd: 2 of 2 cases" in text
  rows = [r for r in rows if r.impl.startswith("flash3")]  # No rival ran.
  assert "of 2 cases" not in report.headline(rows)


def test_headline_leaves_dense_mask_cases_out_of_its_means():
  """cuDNN given packed documents as a dense mask computes every pair: those
  cases are listed apart, not in the means or the tallies."""
  rows = [_row("cudnn", "fwd", 1024, 1.0), _row("flash3", "fwd", 1024, 0.8),
          _row("cudnn", "fwd", 4096, 10.0), _row("flash3", "fwd", 4096, 1.0)]
  rows[2].variant = results_lib.DENSE_MASK  # The documents case.
  results_lib.add_ratios(rows, "cudnn")
  lines = report.headline(rows).splitlines()
  means = next(l for l in lines if l.startswith("| fa3 | float16 | 128 | fwd |"))
  assert means.split(" | ")[4] == "1.25 (1.25-1.25; 1) |"
  assert "- fa3 fwd: 1 of 1 cases" in lines
  i = next(i for i, l in enumerate(lines) if l.startswith("Not in the means"))
  assert "dense mask" in lines[i] and lines[i + 1] == "- fa3 fwd: 10.00 (10.00-10.00; 1)"
  plain = [r for r in rows if r.q_len == 1024]
  assert "Not in the means" not in report.headline(plain)


def test_headline_pairs_like_for_like():
  # flash3 (deterministic) against cudnn-det; flash3-nondet against cudnn.
  # ms 0.9 vs 1.2 and 0.6 vs 1.2: speed ratios 1.33 and 2.0, geomean 1.63.
  rows = []
  for t, fl in ((1024, 0.9), (4096, 0.6)):
    rows += [_row("cudnn", "fwd", t, 1.0), _row("flash3", "fwd", t, fl),
             _row("flash3-nondet", "fwd", t, 0.8), _row("cudnn-det", "fwd", t, 1.2)]
  results_lib.add_ratios(rows, "cudnn")
  lines = report.headline(rows).splitlines()
  i = lines.index("Like for like, flash3 over cudnn-det (both deterministic), "
                  "geometric mean (min-max; cases):")
  assert lines[i + 1] == "- fa3 fwd: 1.63 (1.33-2.00; 2)"
  j = lines.index("Like for like, flash3-nondet over cudnn (both free to add with "
                  "atomics), geometric mean (min-max; cases):")
  assert lines[j + 1] == "- fa3 fwd: 1.25 (1.25-1.25; 2)"
  # Without cudnn-det (or flash3-nondet) that pair's lines are absent.
  text = report.headline([r for r in rows if r.impl != "cudnn-det"])
  assert "over cudnn-det" not in text and "flash3-nondet over cudnn" in text
  # Without the baseline (cudnn) only the pair that does not need it.
  alone = [r for r in rows if r.impl != "cudnn"]
  for r in alone:
    r.ratio_to_baseline = None
  results_lib.add_ratios(alone, "cudnn")
  text = report.headline(alone)
  assert text.startswith("Like for like, flash3 over cudnn-det")
  assert "- fa3 fwd: 1.63 (1.33-2.00; 2)" in text and "over cudnn " not in text


def test_markdown_lists_the_subjects_configs_once_per_case():
  rows = synthetic_results()
  for r in rows:
    if r.impl == "flash3":
      r.config = f"fwd ForwardConfig(T={r.q_len}, {r.mask})"
  lines = report.markdown(rows).splitlines()
  start = lines.index("flash3's kernel configs per case:")
  table = lines[start + 2:]
  assert table[0] == "| suite | dtype | D | N/K | T | mask | config |"
  assert len(table) == 2 + 4  # One line per (T, mask) case.
  assert "| fa3 | float16 | 128 | 16/16 | 4096 | causal | fwd ForwardConfig(T=4096, causal) |" in table
  # Without configs (older results files) there is no such section.
  assert "kernel configs" not in report.markdown(synthetic_results())


ENV = {"gpu": "NVIDIA H200", "driver": "580.1", "cuda_runtime": "13.0",
       "jax": "0.11.2", "jaxlib": "0.11.2", "cudnn": "9.10.0",
       "flash3": "0.1.0", "git_commit": "abc", "date": "2026-12-01T00:00:00",
       "command": "flash3-bench --quick"}


def test_csv_and_json_round_trip(tmp_path):
  rows = synthetic_results()
  report.write_csv(tmp_path / "r.csv", rows, ENV)
  report.write_json(tmp_path / "r.json", rows, ENV)
  with open(tmp_path / "r.csv") as f:
    table = list(csv.DictReader(f))
  assert len(table) == len(rows)
  assert {r["gpu"] for r in table} == {"NVIDIA H200"}
  assert {r["cudnn"] for r in table} == {"9.10.0"}
  first = table[0]
  assert float(first["tflops"]) == pytest.approx(rows[0].tflops)
  assert len(first["times_ms"].split()) == 3
  env, back = report.read_json(tmp_path / "r.json")
  assert env == ENV and back == rows
  raw = json.loads((tmp_path / "r.json").read_text())
  assert {"driver", "jax", "cudnn", "date", "gpu"} <= set(raw["environment"])


def test_environment_on_this_machine():
  env = report.environment(["--quick"])
  assert set(report.ENV_FIELDS) <= set(env)
  assert env["jax"] == jax.__version__ and env["gpu"]
  assert env["command"] == "flash3-bench --quick"
  assert env["date"][:2] == "20"


def test_plots_written_from_synthetic_results(tmp_path):
  paths = plots.plot(synthetic_results(), str(tmp_path), ENV)
  names = sorted(p.rsplit("/", 1)[1] for p in paths)
  assert names == ["fa3_float16_bwd.png", "fa3_float16_fwd.png",
                   "fa3_float16_fwd_bwd.png"]
  for p in paths:
    with open(p, "rb") as f:
      assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  groups = plots.figure_groups(synthetic_results())
  assert {r.impl for r in groups[("fa3", "float16", "fwd+bwd")]} == {
      "cudnn", "flash3"}  # The unsupported contender draws nothing.


def test_replot_from_json(tmp_path, capsys):
  report.write_json(tmp_path / "r.json", synthetic_results(), ENV)
  out = tmp_path / "again"
  assert cli.main(["--replot", str(tmp_path / "r.json"), "--out",
                   str(out)]) == 0
  assert {p.name for p in out.iterdir()} == {
      "results.json", "results.csv", "table.txt", "summary.md", "plots"}
  assert len(list((out / "plots").iterdir())) == 3
  assert "flash3" in capsys.readouterr().out


def _split_by_length(rows):
  """Two "shards" of results: T = 1024 finished, T = 4096 cut off (its
  checkpoint: measured rows only, no bwd rows, no ratios)."""
  done = [r for r in rows if r.q_len == 1024]
  cut = [dataclasses.replace(r, ratio_to_baseline=None) for r in rows
         if r.q_len == 4096 and r.mode != "bwd"]
  return done, cut


def _dicts(rows):
  return sorted((r.to_dict() for r in rows),
                key=lambda d: json.dumps(d, sort_keys=True))


def test_merge_shards_equals_one_run(tmp_path, capsys):
  whole = synthetic_results()
  done, cut = _split_by_length(whole)
  report.write_json(tmp_path / "s0.json", done, ENV)
  (tmp_path / "s1").mkdir()
  env1 = dict(ENV, date="2026-12-01T00:05:00", command="flash3-bench --shard 1/2")
  report.write_json(tmp_path / "s1" / "results.json", cut, env1)
  out = tmp_path / "merged"
  assert cli.main(["--merge", str(tmp_path / "s0.json"), str(tmp_path / "s1"),
                   "--out", str(out), "--no-plots"]) == 0
  env, rows = report.read_json(out / "results.json")
  assert _dicts(rows) == _dicts(whole)  # bwd rows and ratios derived again.
  assert env["gpu"] == "NVIDIA H200" and env["cudnn"] == "9.10.0"
  assert env["date"] == "2026-12-01T00:00:00 ; 2026-12-01T00:05:00"
  assert env["command"] == "flash3-bench --quick ; flash3-bench --shard 1/2"
  table = (out / "table.txt").read_text()
  assert len(table.splitlines()) == 2 + len(whole)
  assert "flash3" in capsys.readouterr().out


def test_replot_of_one_finished_run_changes_nothing(tmp_path):
  report.write_json(tmp_path / "r.json", synthetic_results(), ENV)
  assert cli.main(["--replot", str(tmp_path / "r.json"), "--out",
                   str(tmp_path / "again"), "--no-plots"]) == 0
  env, rows = report.read_json(tmp_path / "again" / "results.json")
  assert env == ENV and _dicts(rows) == _dicts(synthetic_results())


def test_merge_a_rerun_replaces_every_row_of_its_cases():
  """A ratio never pairs rows of two runs: a case re-run replaces all its
  rows (a contender the re-run lacks, too); other cases stay as they were."""
  first = [_row("flash3", "fwd", 1024, 2.0), _row("cudnn", "fwd", 1024, 1.0),
           _row("tokamax", "fwd", 1024, 1.0), _row("jax-mgpu", "fwd", 1024, 1.5),
           _row("flash3", "fwd", 4096, 4.0), _row("cudnn", "fwd", 4096, 5.0)]
  rerun = [_row("flash3", "fwd", 1024, 0.5), _row("cudnn", "fwd", 1024, 1.1),
           _row("tokamax", "fwd", 1024, None, status="unavailable")]
  merged = {(r.impl, r.q_len): r
            for r in results_lib.merge([first, rerun], "cudnn")}
  assert merged["flash3", 1024].median_ms == 0.5  # The re-run's rows.
  assert merged["flash3", 1024].ratio_to_baseline == pytest.approx(2.2)
  assert merged["tokamax", 1024].status == "unavailable"  # Not the old row.
  assert merged["tokamax", 1024].ratio_to_baseline is None
  assert ("jax-mgpu", 1024) not in merged
  assert merged["flash3", 4096].ratio_to_baseline == pytest.approx(1.25)
  assert len(merged) == 5


def test_derived_backward_subtracts_the_same_variants_forward():
  """fwd+bwd of variant A minus fwd of variant A (``fwd_ms``), never the
  forward of another variant that was the fastest forward."""
  fwd = dataclasses.replace(_row("flash3", "fwd", 1024, 1.0), variant="b")
  both = dataclasses.replace(_row("flash3", "fwd+bwd", 1024, 3.0), variant="a")
  (bwd,) = results_lib.derive_backward([fwd, both])
  assert bwd.status == "unsupported" and "variant 'a'" in bwd.reason
  both.fwd_ms = 1.25
  (bwd,) = results_lib.derive_backward([fwd, both])
  assert bwd.status == "ok" and bwd.median_ms == pytest.approx(1.75)
  assert bwd.variant == "a"


def test_merge_environments():
  a = dict(gpu="H200", date="d1", jax="0.11.2")
  b = dict(gpu="H200", date="d2", jax="0.11.2", tokamax="0.0.17")
  assert report.merge_environments([a, b]) == dict(
      gpu="H200", date="d1 ; d2", jax="0.11.2", tokamax="0.0.17")
  assert report.merge_environments([a]) == a


def test_skip_done_leaves_the_cases_a_cut_off_run_did_not_finish(tmp_path,
                                                                 capsys):
  args = cli.parse(["--suite", "gqa", "--impls", "cudnn,flash3"])
  cases = cli.select_cases(args)
  finished = []
  for case in cases[:3]:  # cudnn and flash3, both modes: done.
    finished += [Result.for_case(case, impl, mode, "ok")
                 for impl in ("cudnn", "flash3") for mode in cli.MODES]
  finished += [Result.for_case(cases[3], "cudnn", "fwd", "wrong")]  # Partly.
  left = cli.skip_done(cases, [finished], ["cudnn", "flash3"], cli.MODES)
  assert _ids(left) == _ids(cases[3:])
  assert _ids(cli.skip_done(cases, [finished], ["cudnn"], ("fwd",))) == _ids(
      cases[4:])
  report.write_json(tmp_path / "results.json", finished, ENV)
  assert cli.main(["--list", "--suite", "gqa", "--impls", "cudnn,flash3",
                   "--skip-done", str(tmp_path)]) == 0
  captured = capsys.readouterr()
  assert captured.out.strip().endswith(f"{len(cases) - 3} cases x 2 modes")
  assert "3 of 10 cases already done" in captured.err


# ----- timing -----------------------------------------------------------------

def test_by_kernel_sums_time_per_kernel_name_largest_first():
  split = timing.by_kernel([("dq_kernel", 1.0), ("delta_fusion", 0.1),
                            ("dkv_kernel", 2.0), ("dq_kernel", 0.5)])
  assert list(split) == ["dkv_kernel", "dq_kernel", "delta_fusion"]
  assert split["dq_kernel"] == pytest.approx(1.5)
  assert timing.by_kernel(None) == {}
  assert list(timing.by_kernel([("a" * 80, 1.0)], name_width=70)) == ["a" * 70]


def test_timing_from_measurement():
  t = timing.from_measurement([1.0, 3.0, 2.0, 2.5], 4)
  assert t.median == 2.25 and t.min == 1.0 and t.max == 3.0
  assert t.spread == pytest.approx(2.0 / 2.25)
  assert timing.from_measurement(0.5, 1).times_ms == (0.5,)
  with pytest.raises(RuntimeError, match="no kernel"):
    timing.from_measurement(None, 3)
  with pytest.raises(RuntimeError):
    timing.from_measurement([1.0, 2.0], 3)


# ----- reference and the correctness gate ------------------------------------

def _inputs(case, seed=1):
  q, k, v, do, seg = reference.random_inputs(case, seed)
  return q, k, v, do, seg


@pytest.mark.parametrize("case", [
    Case("t", 2, 40, 40, 4, 2, 32, "float16", causal=True),
    Case("t", 1, 24, 56, 2, 1, 32, "bfloat16", window=(5, 2)),
    Case("t", 2, 48, 48, 2, 2, 32, "bfloat16", causal=True, num_docs=3),
    Case("t", 3, 40, 40, 4, 2, 32, "bfloat16", causal=True,
         seq_lengths=(40, 23, 1)),
    Case("t", 2, 48, 48, 2, 2, 32, "float16", window=(4, 3), num_docs=2,
         seq_lengths=(30, 48)),
])
def test_reference_matches_flash3_xla_with_small_chunks(case, monkeypatch):
  # Force several chunks and a padded last chunk.
  monkeypatch.setattr(reference, "CHUNK_BYTES", 4 * case.batch * case.num_heads
                      * case.kv_len * 17)
  q, k, v, do, seg = _inputs(case)
  lens = None if case.seq_lengths is None else jnp.asarray(case.lengths())
  f = lambda q, k, v: reference.attention(  # noqa: E731
      q, k, v, seg, seg, lens, lens, spec=case.mask_spec, scale=case.scale)
  # Every row, padding too: flash3 (like the reference) writes 0 there.
  g = lambda q, k, v: flash3.dot_product_attention(  # noqa: E731
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32),
      is_causal=case.causal, local_window_size=case.window,
      query_segment_ids=seg, key_value_segment_ids=seg,
      query_seq_lengths=lens, key_value_seq_lengths=lens,
      implementation="xla")
  np.testing.assert_allclose(f(q, k, v), g(q, k, v), rtol=1e-5, atol=1e-5)
  args32 = [x.astype(jnp.float32) for x in (q, k, v)]
  do32 = do.astype(jnp.float32)
  grads_f = jax.vjp(f, *args32)[1](do32)
  grads_g = jax.vjp(g, *args32)[1](do32)
  for a, b in zip(grads_f, grads_g):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def _dense_attention(q, k, v, lengths, *, causal, scale):
  """float32 attention from a (B, Tq, Tk) mask, the textbook way: fully
  masked rows give 0."""
  b, t, n, d = q.shape
  group = n // k.shape[2]
  k, v = (jnp.repeat(x.astype(jnp.float32), group, axis=2) for x in (k, v))
  s = jnp.einsum("bqnd,bknd->bnqk", q.astype(jnp.float32), k,
                 precision="highest") * scale
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  keep = (np.less_equal(j, i) if causal else np.ones((t, t), bool))[None]
  lens = np.asarray(lengths)[:, None, None]
  keep = keep & (i[None] < lens) & (j[None] < lens)  # (B, Tq, Tk)
  s = jnp.where(keep[:, None], s, -jnp.inf)
  p = jnp.exp(s - jnp.max(jnp.where(keep[:, None], s, -1e30), axis=-1,
                          keepdims=True))
  l = p.sum(-1, keepdims=True)
  p = p / jnp.where(l == 0, 1.0, l)
  return jnp.einsum("bnqk,bknd->bqnd", p, v, precision="highest")


def test_reference_with_lengths_equals_dense_float32():
  case = Case("t", 3, 48, 48, 4, 2, 32, "bfloat16", causal=True,
              seq_lengths=(48, 29, 5))
  q, k, v, do, _ = _inputs(case)
  lens = jnp.asarray(case.lengths())
  f = lambda q, k, v: reference.attention(  # noqa: E731
      q, k, v, None, None, lens, lens, spec=case.mask_spec, scale=case.scale)
  g = functools.partial(_dense_attention, lengths=case.lengths(), causal=True,
                        scale=case.scale)
  args = [x.astype(jnp.float32) for x in (q, k, v)]
  o_f, vjp_f = jax.vjp(f, *args)
  o_g, vjp_g = jax.vjp(g, *args)
  np.testing.assert_allclose(o_f, o_g, rtol=1e-5, atol=1e-5)
  # Random cotangents everywhere (padding too): padded rows still give
  # nothing to dk, dv.
  do32 = jax.random.normal(jax.random.key(3), q.shape, jnp.float32)
  grads_f, grads_g = vjp_f(do32), vjp_g(do32)
  for a, b in zip(grads_f, grads_g):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  dq, dk, dv = grads_f
  for b, n in enumerate(case.seq_lengths):  # Padding: exactly 0.
    for x in (o_f, dq, dk, dv):
      assert not np.any(np.asarray(x[b, n:]))
    assert np.all(np.abs(np.asarray(o_f[b, :n])).sum(-1) > 0)
  # random_inputs gives padded query rows a zero cotangent.
  assert not np.any(np.asarray(do[1, 29:])) and np.all(
      np.asarray(do[1, :29]) != 0)


def test_check_compares_only_the_valid_rows():
  case = Case("t", 2, 64, 64, 4, 2, 32, "bfloat16", causal=True,
              seq_lengths=(64, 20))
  q, k, v, do, seg = _inputs(case)
  exp = reference.expected_modes(case, cli.MODES, q, k, v, do, seg)
  lens = jnp.asarray(case.lengths())
  f = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
      q, k, v, is_causal=True, query_seq_lengths=lens,
      key_value_seq_lengths=lens, implementation="xla")
  o = f(q, k, v)
  grads = jax.vjp(f, q, k, v)[1](do)
  assert reference.check(case, exp["fwd"], (o,))[0]
  assert reference.check(case, exp["fwd+bwd"], grads)[0]
  # Whatever is in padded rows or keys of the last slice (batch row 1, rows
  # 20 and up) is not compared, NaN included, as cuDNN may leave them so.
  ok, _, detail = reference.check(case, exp["fwd"],
                                  (o.at[1, 20:].set(jnp.nan),))
  assert ok, detail
  dq, dk, dv = grads
  junk = (dq.at[1, 20:].set(jnp.nan), dk.at[1, 20:].set(7.0),
          dv.at[1, 20:].set(-7.0))
  assert reference.check(case, exp["fwd+bwd"], junk)[0]
  # A valid row still counts.
  ok, ratio, detail = reference.check(case, exp["fwd"],
                                      (o.at[1, 19, 3].add(0.5),))
  assert not ok and ratio > 1 and detail.startswith("o max error")
  ok, _, detail = reference.check(case, exp["fwd+bwd"],
                                  (dq, dk.at[1, 19, 1].set(jnp.nan), dv))
  assert not ok and detail == "dk has NaN or Inf"


def test_check_accepts_input_dtype_math_and_rejects_errors():
  case = Case("t", 2, 64, 64, 4, 2, 32, "bfloat16", causal=True)
  q, k, v, do, seg = _inputs(case)
  exp = reference.expected(case, "fwd", q, k, v, do, seg)
  assert len(exp.values["o"]) == 2  # First and last (batch, kv head) slices.
  good = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                      implementation="xla")
  ok, ratio, _ = reference.check(case, exp, (good,))
  assert ok and ratio <= 1.0
  bad_last = good.at[1, 5, 3, 0].add(0.5)  # Only in the last slice.
  ok, ratio, detail = reference.check(case, exp, (bad_last,))
  assert not ok and ratio > 1.0 and detail.startswith("o max error")
  ok, _, detail = reference.check(case, exp, (good.at[0, 0, 0, 0].set(
      jnp.nan),))
  assert not ok and "NaN" in detail


def test_one_reference_program_serves_both_modes():
  case = Case("t", 2, 40, 40, 4, 2, 32, "bfloat16", causal=True)
  q, k, v, do, seg = _inputs(case)
  both = reference.expected_modes(case, ("fwd", "fwd+bwd"), q, k, v, do, seg)
  alone = reference.expected(case, "fwd", q, k, v, do, seg)  # No gradients.
  assert both["fwd"].names == ("o",)
  assert both["fwd+bwd"].names == ("dq", "dk", "dv")
  for got, want in zip(both["fwd"].values["o"], alone.values["o"]):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert both["fwd"].tol["o"] == pytest.approx(alone.tol["o"], rel=1e-5)
  with pytest.raises(ValueError, match="mode"):
    reference.expected_modes(case, ("bwd",), q, k, v, do, seg)


def test_reference_compiled_in_a_thread_gives_the_same_numbers():
  import threading
  case = Case("t", 2, 40, 40, 4, 2, 32, "bfloat16", causal=True, num_docs=2)
  q, k, v, do, seg = _inputs(case)
  modes = ("fwd", "fwd+bwd")
  prog = reference.program(case, modes, q, k, v, do, seg)
  assert prog.compiled is None and len(prog.calls) == 2
  thread = threading.Thread(target=reference.compile_program, args=(prog,))
  thread.start()
  thread.join()
  # Both slices have one shape: one executable serves both.
  assert len(prog.compiled) == 2 and prog.compiled[0] is prog.compiled[1]
  ahead = reference.run_program(prog)
  direct = reference.expected_modes(case, modes, q, k, v, do, seg)
  for mode in modes:
    assert ahead[mode].names == direct[mode].names
    assert ahead[mode].tol == direct[mode].tol  # Exactly.
    for name in direct[mode].names:
      for a, b in zip(ahead[mode].values[name], direct[mode].values[name]):
        np.testing.assert_array_equal(a, b)
  with pytest.raises(ValueError, match="mode"):
    reference.program(case, ("bwd",), q, k, v, do, seg)


def test_check_gradients_and_prescaled_q():
  case = Case("t", 1, 64, 64, 2, 2, 64, "float16")
  q, k, v, do, seg = _inputs(case)
  exp = reference.expected(case, "fwd+bwd", q, k, v, do, seg)
  assert exp.names == ("dq", "dk", "dv")
  # A contender without softmax scale, fed q * scale, as jax-mgpu is.
  qs = (q.astype(jnp.float32) * case.scale).astype(q.dtype)
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=1.0)  # noqa
  grads = jax.vjp(f, qs, k, v)[1](do)
  ok, _, detail = reference.check(case, exp, grads, q_grad_scale=case.scale)
  assert ok, detail
  ok, _, detail = reference.check(case, exp, grads)  # Forgetting the scale.
  assert not ok and detail.startswith("dq")


# ----- the runner, with stand-in contenders and clock --------------------------

def _stand_in(name, fn=None, raise_at_build=None, unavailable=None, config=""):
  def variants(case, tune):
    if raise_at_build:
      raise impls.Unsupported(raise_at_build)
    return [impls.Variant("", fn, config=config)]
  return impls.Implementation(name, name, lambda: unavailable, variants)


def test_runner_reports_ok_wrong_unsupported_unavailable(monkeypatch):
  clock = {"fwd": 1.0, "fwd+bwd": 3.0}
  calls = []

  def fake_measure(fn, args, iterations, warmup):
    calls.append(iterations)
    # fn is a compiled executable (no eval_shape); one output for "fwd".
    mode = "fwd" if len(fn(*args)) == 1 else "fwd+bwd"
    return timing.Timing(tuple([clock[mode]] * iterations))

  monkeypatch.setattr(timing, "measure", fake_measure)
  xla = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
      q, k, v, is_causal=True, implementation="xla")

  def crashes(q, k, v):
    raise NotImplementedError("head_dim 32 is not supported\nmore detail")

  contenders = [
      _stand_in("cudnn", xla, config="cfg-1"),
      _stand_in("wrong", lambda q, k, v: xla(q, k, v) * 1.1),
      _stand_in("crashes", crashes),
      _stand_in("refuses", raise_at_build="float16 only"),
      _stand_in("absent", unavailable="import failed"),
  ]
  case = Case("t", 1, 64, 64, 2, 2, 32, "bfloat16", causal=True)
  rows = runner.run([case], contenders, runner.Options(iterations=3))
  got = {(r.impl, r.mode): r for r in rows}
  assert len(rows) == 5 * 3
  ok = got[("cudnn", "fwd")]
  assert ok.status == "ok" and ok.median_ms == 1.0 and ok.times_ms == [1.0] * 3
  assert ok.tflops == pytest.approx(flops_lib.flops(case, "fwd") / 1e-3 / 1e12)
  assert ok.ratio_to_baseline == pytest.approx(1.0)
  assert got[("cudnn", "bwd")].median_ms == pytest.approx(2.0)
  # The variant's config is recorded on its rows, the derived backward's too.
  assert [got[("cudnn", m)].config for m in ("fwd", "fwd+bwd", "bwd")] == ["cfg-1"] * 3
  assert got[("wrong", "fwd")].config == ""
  assert got[("wrong", "fwd")].status == "wrong"
  assert got[("wrong", "fwd")].median_ms is None  # A wrong result is not timed.
  assert got[("wrong", "fwd+bwd")].status == "wrong"
  assert got[("crashes", "fwd")].status == "unsupported"
  assert got[("crashes", "fwd")].reason == (
      "NotImplementedError: head_dim 32 is not supported")
  assert got[("refuses", "fwd+bwd")].reason == "Unsupported: float16 only"
  assert got[("absent", "bwd")].status == "unavailable"
  assert calls == [3, 3]  # Only the correct contender was timed.


def test_runner_derives_the_backward_within_one_variant(monkeypatch):
  """Variant "b" has the fastest forward and "a" the fastest fwd+bwd: the
  backward is a's fwd+bwd minus a's forward."""
  clock = {(1.0, "fwd"): 1.0, (1.0, "fwd+bwd"): 3.0,
           (2.0, "fwd"): 0.8, (2.0, "fwd+bwd"): 3.5}

  def fake_measure(fn, args, iterations, warmup):
    mode = "fwd" if len(fn(*args)) == 1 else "fwd+bwd"
    return timing.Timing((clock[float(args[-1][0]), mode],) * iterations)

  monkeypatch.setattr(timing, "measure", fake_measure)

  def fn(q, k, v, m):
    del m  # Only tells the variants apart in the clock above.
    return jax.nn.dot_product_attention(q, k, v, implementation="xla")
  variants = lambda case, tune: [  # noqa: E731
      impls.Variant(label, fn, aux=(jnp.array([marker]),))
      for label, marker in (("a", 1.0), ("b", 2.0))]
  contenders = [impls.Implementation("cudnn", "cudnn", lambda: None, variants)]
  case = Case("t", 1, 64, 64, 2, 2, 64, "bfloat16")
  rows = {r.mode: r for r in runner.run([case], contenders,
                                        runner.Options(iterations=3))}
  assert rows["fwd"].variant == "b" and rows["fwd"].median_ms == 0.8
  assert rows["fwd+bwd"].variant == "a" and rows["fwd+bwd"].fwd_ms == 1.0
  assert rows["bwd"].variant == "a"
  assert rows["bwd"].median_ms == pytest.approx(2.0)


def test_runner_interleaves_the_timing_of_contenders(monkeypatch):
  """--interleave: every contender is checked first, then timed in rounds
  with the first in each round rotating; each row pools its rounds' runs,
  and a wrong contender is not timed. The stand-in clock slows down run by
  run (a card whose clock drifts): interleaved, two equal contenders come
  out within a round's drift of each other."""
  order = []
  state = {"ms": 1.0}

  def fake_measure(fn, args, iterations, warmup):
    order.append((float(args[-1][0]), iterations, warmup))  # the marker
    times = []
    for _ in range(iterations):
      times.append(state["ms"])
      state["ms"] += 0.01
    return timing.Timing(tuple(times))

  monkeypatch.setattr(timing, "measure", fake_measure)

  def stand_in(name, marker, scale=1.0):
    def fn(q, k, v, m):
      del m  # Only tells the stand-ins apart in the clock above.
      return scale * jax.nn.dot_product_attention(q, k, v, implementation="xla")
    variants = lambda case, tune: [impls.Variant("", fn, aux=(jnp.array([marker]),))]
    return impls.Implementation(name, name, lambda: None, variants)

  contenders = [stand_in("a", 1.0), stand_in("b", 2.0),
                stand_in("wrong", 3.0, scale=1.5)]
  case = Case("t", 1, 64, 64, 2, 2, 64, "bfloat16")
  options = runner.Options(iterations=6, warmup=1, modes=("fwd",), interleave=3)
  rows = {(r.impl, r.mode): r for r in runner.run([case], contenders, options)}
  assert [o[0] for o in order] == [1.0, 2.0, 2.0, 1.0, 1.0, 2.0]
  assert [o[1] for o in order] == [2] * 6  # ceil(6 / 3) runs per round
  assert [o[2] for o in order] == [1, 1, 0, 0, 0, 0]  # warm-up in round one
  a, b = rows[("a", "fwd")], rows[("b", "fwd")]
  assert a.status == b.status == "ok" and len(a.times_ms) == len(b.times_ms) == 6
  assert abs(a.median_ms - b.median_ms) <= 0.021
  assert rows[("wrong", "fwd")].status == "wrong"
  assert rows[("wrong", "fwd")].median_ms is None
  with pytest.raises(ValueError, match="interleave"):
    runner.Options(interleave=2, compile_jobs=1)
  with pytest.raises(ValueError, match="interleave"):
    runner.Options(iterations=3, interleave=4)


def test_runner_interleaved_failures_and_nothing_to_time(monkeypatch):
  """A contender whose timing fails in a later round is reported unsupported
  and left out of the rounds after; a mode where no contender passes the
  check times nothing."""
  calls = []

  def fake_measure(fn, args, iterations, warmup):
    marker = float(args[-1][0])
    calls.append(marker)
    if marker == 2.0 and len(calls) > 2:
      raise RuntimeError("CUPTI recorded no kernel launch")
    return timing.Timing((1.0,) * iterations)

  monkeypatch.setattr(timing, "measure", fake_measure)

  def stand_in(name, marker, scale=1.0):
    def fn(q, k, v, m):
      del m
      return scale * jax.nn.dot_product_attention(q, k, v, implementation="xla")
    variants = lambda case, tune: [impls.Variant("", fn, aux=(jnp.array([marker]),))]
    return impls.Implementation(name, name, lambda: None, variants)

  case = Case("t", 1, 64, 64, 2, 2, 64, "bfloat16")
  options = runner.Options(iterations=4, modes=("fwd",), interleave=4)
  rows = {r.impl: r for r in runner.run(
      [case], [stand_in("a", 1.0), stand_in("b", 2.0)], options)}
  assert calls == [1.0, 2.0, 2.0, 1.0, 1.0, 1.0]  # b fails in round two, then no more
  assert rows["a"].status == "ok" and rows["a"].times_ms == [1.0] * 4
  assert rows["b"].status == "unsupported"
  assert rows["b"].reason == "RuntimeError: CUPTI recorded no kernel launch"
  calls.clear()
  rows = runner.run([case], [stand_in("wrong", 3.0, scale=1.5)], options)
  assert calls == [] and rows[0].status == "wrong"


@pytest.mark.parametrize("causal", [True, False])
def test_runner_passes_a_padding_case_with_the_xla_contender(causal,
                                                             monkeypatch):
  monkeypatch.setattr(timing, "measure", lambda fn, args, iterations, warmup:
                      timing.Timing((1.0,) * iterations))
  case = Case("t", 4, 64, 64, 4, 2, 32, "bfloat16", causal=causal,
              seq_lengths=(64, 48, 32, 16))
  (variant,) = impls.IMPLEMENTATIONS["xla"].variants(case, True)
  (lens,) = variant.aux
  assert lens.dtype == jnp.int32 and lens.tolist() == [64, 48, 32, 16]
  rows = runner.run([case], [impls.IMPLEMENTATIONS["xla"]],
                    runner.Options(iterations=2))
  got = {r.mode: r for r in rows}
  for mode in ("fwd", "fwd+bwd", "bwd"):
    assert got[mode].status == "ok", got[mode].reason
    assert got[mode].mask == case.mask
  assert got["fwd"].check_ratio <= 1.0 and got["fwd+bwd"].check_ratio <= 1.0
  pairs = [n * (n + 1) // 2 if causal else n * n for n in (64, 48, 32, 16)]
  assert got["fwd"].flops == flops_lib.forward_flops(case) == (
      4 * 4 * 32 * sum(pairs))
  # Ignoring the lengths is wrong on the valid rows, except with causal:
  # there a valid query sees only valid keys anyway, and padded rows (zero
  # cotangent) reach no gradient; only the wasted work would tell.
  no_lengths = impls.Variant("", lambda q, k, v: variant.fn(
      q, k, v, jnp.full((4,), 64, jnp.int32)))
  rows = runner.run([case], [impls.Implementation(
      "xla", "", lambda: None, lambda case, tune: [no_lengths])],
      runner.Options(iterations=2))
  assert {r.status for r in rows} == {"ok" if causal else "wrong"}


def test_runner_checkpoints_each_case_and_honours_time_budget(monkeypatch, capsys):
  monkeypatch.setattr(timing, "measure", lambda fn, args, iterations, warmup:
                      timing.Timing((1.0,) * iterations))
  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)  # noqa: E731
  cases = [Case("t", 1, 64, 64, 2, 2, 32, "bfloat16", causal=False),
           Case("t", 1, 128, 128, 2, 2, 32, "bfloat16", causal=False)]
  saved = []
  options = runner.Options(iterations=2, modes=("fwd",))
  rows = runner.run(cases, [_stand_in("cudnn", xla)], options,
                    checkpoint=lambda rows: saved.append(len(rows)))
  assert saved == [1, 2] and len(rows) == 2
  saved.clear()
  rows = runner.run(cases, [_stand_in("cudnn", xla)], options,
                    checkpoint=lambda rows: saved.append(len(rows)), time_budget_s=-1)
  assert rows == [] and saved == []
  assert "2 cases not run" in capsys.readouterr().err


def test_time_budget_is_a_deadline_judged_by_the_longest_case(monkeypatch,
                                                               capsys):
  clock = {"now": 0.0}

  class FakeTime:
    @staticmethod
    def monotonic():
      return clock["now"]

  def fake_measure(fn, args, iterations, warmup):
    clock["now"] += 10.0  # Each case "takes" 10 s.
    return timing.Timing((1.0,) * iterations)

  monkeypatch.setattr(runner, "time", FakeTime)
  monkeypatch.setattr(timing, "measure", fake_measure)
  xla = lambda q, k, v: jax.nn.dot_product_attention(q, k, v)  # noqa: E731
  cases = [Case("t", 1, t, t, 2, 2, 32, "bfloat16") for t in (16, 32, 48)]
  lines = []
  rows = runner.run(cases, [_stand_in("cudnn", xla)],
                    runner.Options(iterations=2, modes=("fwd",)),
                    time_budget_s=25, start=0.0, log=lines.append)
  # Case 2 starts at 10 s (10 + 10 <= 25); case 3 would end near 30 s.
  assert [r.q_len for r in rows] == [16, 32]
  assert "1 cases not run" in capsys.readouterr().err
  assert len(lines) == 2 and "case 1/3" in lines[0] and "10.0 s" in lines[0]
  # The split: the fake clock only moves while timing.
  assert "(reference 0.0 s, compile 0.0 s, run 10.0 s; 10 s in all)" in lines[0]


def _no_such_kernel(q, k, v):
  """Traces and lowers, but no compiler has this custom call: fails in
  ``.compile()`` itself. (Its inputs stop gradients, as an FFI call has no
  derivative; ``0 * q`` gives the backward something to differentiate; a
  side effect keeps the call in the backward, which drops the output.)"""
  call = jax.ffi.ffi_call("flash3_no_such_kernel",
                          jax.ShapeDtypeStruct(q.shape, q.dtype),
                          has_side_effect=True)
  return call(*map(jax.lax.stop_gradient, (q, k, v))) + 0 * q


def _parallel_contenders():
  xla = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
      q, k, v, is_causal=True, implementation="xla")

  def crashes(q, k, v):
    raise NotImplementedError("head_dim 32 is not supported")

  def tuned(case, tune):
    # The first variant fails to compile, the second is slower (its aux
    # argument costs 1 ms in the fake timing below), the third is the best.
    return [impls.Variant("broken", _no_such_kernel),
            impls.Variant("slow", lambda q, k, v, extra: xla(q, k, v),
                          (jnp.zeros(3),)),
            impls.Variant("fast", xla)]

  return [
      _stand_in("cudnn", xla),
      impls.Implementation("tuned", "tuned", lambda: None, tuned),
      _stand_in("broken", _no_such_kernel),
      _stand_in("wrong", lambda q, k, v: xla(q, k, v) * 1.1),
      _stand_in("crashes", crashes),
      _stand_in("refuses", raise_at_build="float16 only"),
      _stand_in("absent", unavailable="import failed"),
  ]


def _fields(rows):
  return [(r.impl, r.mode, r.status, r.variant, r.reason, r.median_ms,
           r.check_ratio) for r in rows]


@pytest.mark.parametrize("jobs", [1, 4])
def test_parallel_compile_gives_the_serial_results(jobs, monkeypatch):
  import threading
  events = []
  compile_function = runner.compile_function

  compile_program = reference.compile_program

  def recording_compile(variant, mode, args):
    events.append(("compile", threading.current_thread().name))
    return compile_function(variant, mode, args)

  def recording_reference(program):
    events.append(("reference", threading.current_thread().name))
    return compile_program(program)

  def fake_measure(fn, args, iterations, warmup):
    events.append(("measure", threading.current_thread().name))
    return timing.Timing((1.0 + len(args) - 4,) * iterations)

  monkeypatch.setattr(runner, "compile_function", recording_compile)
  monkeypatch.setattr(reference, "compile_program", recording_reference)
  monkeypatch.setattr(timing, "measure", fake_measure)
  case = Case("t", 1, 64, 64, 2, 2, 32, "bfloat16", causal=True)
  lines = []
  rows = runner.run([case], _parallel_contenders(),
                    runner.Options(iterations=2, compile_jobs=jobs),
                    log=lines.append)
  got = {(r.impl, r.mode): r for r in rows}
  for mode in ("fwd", "fwd+bwd"):
    assert got[("tuned", mode)].status == "ok"
    assert got[("tuned", mode)].variant == "fast"
    assert got[("tuned", mode)].median_ms == 1.0
    broken = got[("broken", mode)]
    assert broken.status == "unsupported"
    assert broken.reason.startswith("JaxRuntimeError: ")
    assert "flash3_no_such_kernel" in broken.reason
    assert got[("wrong", mode)].status == "wrong"
    assert got[("crashes", mode)].reason == (
        "NotImplementedError: head_dim 32 is not supported")
    assert got[("refuses", mode)].reason == "Unsupported: float16 only"
    assert got[("absent", mode)].status == "unavailable"
  # The reference once, for both modes.
  references = [i for i, (kind, _) in enumerate(events) if kind == "reference"]
  assert len(references) == 1
  ref_thread = events[references[0]][1]
  # cudnn, tuned x3, broken, wrong, crashes; both modes.
  compiles = [name for kind, name in events if kind == "compile"]
  assert len(compiles) == 2 * 7
  measures = [i for i, (kind, _) in enumerate(events) if kind == "measure"]
  assert len(measures) == 2 * 3  # cudnn, tuned slow and fast.
  assert all(name == "MainThread" for kind, name in events
             if kind == "measure")
  if jobs == 1:  # Each compiled just before it runs, on the main thread.
    assert set(compiles) == {"MainThread"} and ref_thread == "MainThread"
    assert references == [0]  # Compiled (and run) before any contender's.
    assert events[1][0] == "compile" and events[2][0] == "measure"
  else:  # All, the reference too, compiled in the pool before any timing.
    assert all(n.startswith("flash3-bench-compile") for n in compiles)
    assert ref_thread.startswith("flash3-bench-compile")
    assert references[0] < measures[0] == len(compiles) + 1
  assert "reference " in lines[0]
  assert "compile " in lines[0] and "run " in lines[0]
  if jobs == 4:
    serial = runner.run([case], _parallel_contenders(),
                        runner.Options(iterations=2, compile_jobs=1))
    assert _fields(rows) == _fields(serial)


def test_reference_compile_failure_gives_the_same_rows(monkeypatch):
  measured = []
  monkeypatch.setattr(timing, "measure", lambda fn, args, iterations, warmup:
                      measured.append(1) or timing.Timing((1.0,) * iterations))

  @functools.partial(jax.jit, static_argnames=("with_grads", "spec", "scale",
                                               "dtype"))
  def broken(args, do, q_seg, kv_seg, lengths, *, with_grads, spec, scale,
             dtype):
    out = {"o": _no_such_kernel(*args).astype(jnp.float32)}
    return out, out

  monkeypatch.setattr(reference, "_references", broken)
  case = Case("t", 1, 64, 64, 2, 2, 32, "bfloat16", causal=True)
  contenders = _parallel_contenders()
  got = {}
  for jobs in (1, 4):
    times = runner.CaseTimes()
    rows = runner.run_case(case, contenders,
                           runner.Options(iterations=2, compile_jobs=jobs,
                                          modes=cases_lib.MODES),
                           {"absent": "import failed"}, times=times)
    got[jobs] = _fields(rows)
    # One row per contender (the unavailable one too) and mode, as when the
    # reference failed before any contender was compiled.
    assert [(r.impl, r.mode) for r in rows] == [
        (c.name, mode) for mode in cases_lib.MODES for c in contenders]
    assert {r.status for r in rows} == {"unsupported"}
    reasons = {r.reason for r in rows}
    assert len(reasons) == 1
    reason = reasons.pop()
    assert reason.startswith("reference failed: JaxRuntimeError: ")
    assert "flash3_no_such_kernel" in reason
    assert times.run == 0.0
    assert (times.compile > 0.0) == (jobs > 1)  # Failed in the pool.
  assert got[1] == got[4]
  assert measured == []


def test_compile_jobs_reach_the_runner(monkeypatch, tmp_path):
  seen = []

  def fake_run(cases, impls_, options, **kwargs):
    seen.append(options)
    return []

  monkeypatch.setattr(cli, "hopper_problem", lambda: None)
  monkeypatch.setattr(runner, "run", fake_run)
  argv = ["--shape", "B=1,T=64,N=2,D=64", "--impls", "xla", "--no-plots",
          "--no-progress", "--out", str(tmp_path)]
  assert cli.main(argv + ["--compile-jobs", "3"]) == 0
  assert cli.main(argv) == 0
  assert [o.compile_jobs for o in seen] == [3, 8]


def test_select_implementations():
  assert [i.name for i in impls.select(None)] == [
      "flash3", "cudnn", "xla", "jax-mgpu", "tokamax"]
  assert [i.name for i in impls.select(["tokamax", "cudnn"])] == [
      "cudnn", "tokamax"]
  # The determinism counterparts run only when named.
  assert [i.name for i in impls.select(["flash3-nondet", "cudnn-det", "cudnn"])] == [
      "cudnn", "cudnn-det", "flash3-nondet"]
  with pytest.raises(ValueError, match="unknown"):
    impls.select(["cuda"])


def test_contenders_refuse_what_they_cannot_do():
  bf16 = Case("t", 1, 256, 256, 2, 2, 64, "bfloat16")
  with pytest.raises(impls.Unsupported, match="float16"):
    impls.IMPLEMENTATIONS["jax-mgpu"].variants(bf16, True)
  window = Case("t", 1, 256, 256, 2, 2, 64, "float16", causal=True,
                window=(8, 0))
  with pytest.raises(impls.Unsupported, match="window"):
    impls.IMPLEMENTATIONS["jax-mgpu"].variants(window, True)
  if impls.IMPLEMENTATIONS["jax-mgpu"].unavailable() is None:
    # (Its module imports absl, present on the GPU machines, maybe not here.)
    f16 = Case("t", 1, 256, 256, 2, 2, 64, "float16")
    tuned = impls.IMPLEMENTATIONS["jax-mgpu"].variants(f16, True)
    assert len(tuned) == 3 and all(v.q_scale == 0.125 for v in tuned)
    assert len(impls.IMPLEMENTATIONS["jax-mgpu"].variants(f16, False)) == 1
    for d, block_kv in ((64, 256), (128, 128), (256, 64), (96, 128)):
      (untuned,) = impls.IMPLEMENTATIONS["jax-mgpu"].variants(
          dataclasses.replace(f16, head_dim=d), False)
      assert untuned.label == f"block_q=64 block_kv={block_kv}"
  huge = Case("t", 1, 131072, 131072, 16, 16, 128)
  with pytest.raises(impls.Unsupported, match="GiB"):
    impls.IMPLEMENTATIONS["xla"].variants(huge, True)
  docs = Case("t", 1, 64, 64, 2, 2, 64, num_docs=2)
  (variant,) = impls.IMPLEMENTATIONS["cudnn"].variants(docs, True)
  assert variant.label == "dense mask" and variant.aux[0].shape == (1, 1, 64,
                                                                     64)
  padded = Case("t", 2, 64, 64, 2, 2, 64, "float16", causal=True,
                seq_lengths=(64, 30))
  with pytest.raises(impls.Unsupported, match="padding lengths"):
    impls.IMPLEMENTATIONS["jax-mgpu"].variants(padded, True)
  for name in ("cudnn", "xla"):
    (variant,) = impls.IMPLEMENTATIONS[name].variants(padded, True)
    assert variant.label == "" and len(variant.aux) == 1
    assert variant.aux[0].dtype == jnp.int32
    assert variant.aux[0].tolist() == [64, 30]
  both = dataclasses.replace(padded, num_docs=2)
  (variant,) = impls.IMPLEMENTATIONS["cudnn"].variants(both, True)
  assert variant.label == "dense mask"
  assert [a.shape for a in variant.aux] == [(2, 1, 64, 64), (2,)]


def test_flash3_contender_passes_lengths_and_segment_ids(monkeypatch):
  seen = {}

  def fake(q, k, v, **kwargs):
    seen.update(kwargs)
    return q

  monkeypatch.setattr(flash3, "dot_product_attention", fake)
  case = Case("t", 2, 64, 64, 2, 2, 64, causal=True, num_docs=2,
              seq_lengths=(64, 30))
  (variant,) = impls.IMPLEMENTATIONS["flash3"].variants(case, True)
  q = jnp.zeros((2, 64, 2, 64))
  variant.fn(q, q, q, *variant.aux)
  assert seen["is_causal"] and seen["implementation"] == "mosaic"
  assert seen["query_segment_ids"] is seen["key_value_segment_ids"]
  assert seen["query_segment_ids"].shape == (2, 64)
  assert seen["query_seq_lengths"] is seen["key_value_seq_lengths"]
  assert seen["query_seq_lengths"].tolist() == [64, 30]


def test_determinism_counterparts(monkeypatch):
  """cudnn-det is cuDNN compiled with XLA's deterministic ops; flash3-nondet
  calls flash3 with deterministic=False and records that backward config."""
  case = Case("t", 2, 64, 64, 2, 2, 64, causal=False)
  (plain,) = impls.IMPLEMENTATIONS["cudnn"].variants(case, True)
  (det,) = impls.IMPLEMENTATIONS["cudnn-det"].variants(case, True)
  assert plain.compiler_options == () and dict(det.compiler_options) == {
      "xla_gpu_deterministic_ops": True}
  assert "deterministic_ops" in det.config
  seen = {}
  monkeypatch.setattr(flash3, "dot_product_attention",
                      lambda q, k, v, **kw: seen.update(kw) or q)
  (nondet,) = impls.IMPLEMENTATIONS["flash3-nondet"].variants(case, True)
  q = jnp.zeros((2, 64, 2, 64))
  nondet.fn(q, q, q, *nondet.aux)
  assert seen["deterministic"] is False and seen["implementation"] == "mosaic"
  assert "deterministic=False" in nondet.config
  (default,) = impls.IMPLEMENTATIONS["flash3"].variants(case, True)
  default.fn(q, q, q, *default.aux)
  assert seen["deterministic"] is True and "deterministic=True" in default.config


@pytest.mark.gpu
def test_cudnn_det_backward_is_reproducible():
  """cudnn-det's compiler option must reach cuDNN: its dq, a sum over many key
  tiles, is bitwise the same run to run (cuDNN's default backward adds dq
  with atomics)."""
  case = Case("t", 2, 4096, 4096, 16, 16, 128, "bfloat16", causal=False)
  (variant,) = impls.IMPLEMENTATIONS["cudnn-det"].variants(case, True)
  keys = jax.random.split(jax.random.key(0), 4)
  x = [jax.random.normal(kk, (2, 4096, 16, 128), jnp.bfloat16) for kk in keys]
  args = (*x, *variant.aux)
  f = runner.compile_function(variant, "fwd+bwd", args)
  first = [np.asarray(g, np.float32) for g in f(*args)]
  for _ in range(3):
    for a, b in zip(first, f(*args)):
      np.testing.assert_array_equal(a, np.asarray(b, np.float32))


def test_timed_function_is_compiled_with_the_variant_options():
  case = Case("t", 1, 32, 32, 2, 2, 16, "bfloat16")
  (variant,) = impls.IMPLEMENTATIONS["xla"].variants(case, True)
  x = jnp.zeros((1, 32, 2, 16), jnp.bfloat16)
  args = (x, x, x, x, *variant.aux)
  det = dataclasses.replace(variant, compiler_options=impls.DETERMINISTIC_OPS)
  runner.compile_function(det, "fwd+bwd", args)  # An XLA option: accepted.
  bogus = dataclasses.replace(variant, compiler_options=(("no_such_xla_option", 1),))
  with pytest.raises(Exception, match="no_such_xla_option"):
    runner.compile_function(bogus, "fwd", args)


def test_tokamax_gets_jax_nn_arguments(monkeypatch):
  """The tokamax contender's call (BTNH, is_causal, window, dense mask,
  lengths), run
  through tokamax's XLA path on this CPU; only "mosaic" differs on the GPU.
  Runs where tokamax imports (scripts/with_tokamax.sh), else skipped."""
  pytest.importorskip("tokamax")
  monkeypatch.setattr(impls, "TOKAMAX_IMPLEMENTATION", "xla")
  for case in (Case("t", 2, 128, 128, 4, 2, 64, "bfloat16", causal=True),
               Case("t", 1, 128, 128, 2, 2, 64, "bfloat16", causal=True,
                    window=(16, 0)),
               Case("t", 2, 96, 96, 2, 2, 64, "bfloat16", num_docs=3),
               Case("t", 3, 128, 128, 2, 2, 64, "bfloat16", causal=True,
                    seq_lengths=(128, 70, 9))):
    (variant,) = impls.IMPLEMENTATIONS["tokamax"].variants(case, True)
    q, k, v, do, seg = reference.random_inputs(case)
    expectations = reference.expected_modes(case, cli.MODES, q, k, v, do, seg)
    for mode in cli.MODES:
      out = runner.timed_function(variant, mode)(q, k, v, do, *variant.aux)
      ok, _, detail = reference.check(case, expectations[mode], out)
      assert ok, (case.label(), mode, detail)


def test_source_tree_hash_is_gits_tree_hash(tmp_path):
  # The environment's source_tree names the code that ran, comparable with
  # `git rev-parse <commit>:src/flash3` even where a copy's .git lags.
  import shutil
  import subprocess
  if shutil.which("git") is None:
    pytest.skip("no git")
  pkg = tmp_path / "pkg"
  (pkg / "sub" / "__pycache__").mkdir(parents=True)
  (pkg / "a.py").write_text("x = 1\n")
  (pkg / "sub" / "b.py").write_text("y = 2\n")
  (pkg / "sub-c.txt").write_text("sorts between sub and sub/\n")
  (pkg / "run.sh").write_text("#!/bin/sh\n")
  (pkg / "run.sh").chmod(0o755)
  (pkg / "sub" / "__pycache__" / "b.cpython-312.pyc").write_bytes(b"\0")
  git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True,
                                  capture_output=True, text=True).stdout.strip()
  git("init", "-q")
  git("add", "pkg/a.py", "pkg/sub/b.py", "pkg/sub-c.txt", "pkg/run.sh")
  want = git("write-tree")
  want = git("rev-parse", f"{want}:pkg")
  assert report.source_tree_hash(str(pkg)) == want[:12]
  (pkg / "a.py").write_text("x = 2\n")  # A changed file: another hash.
  assert report.source_tree_hash(str(pkg)) != want[:12]


@pytest.mark.parametrize("argv,want", [([], 10), (["--quick"], 5), (["--iterations", "4"], 4),
                                       (["--compile-jobs", "1"], 0),
                                       (["--interleave", "0"], 0),
                                       (["--interleave", "2"], 2)])
def test_interleave_defaults_to_one_run_per_turn(argv, want):
  assert cli.parse(argv).interleave == want
