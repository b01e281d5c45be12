"""scripts/tune.py, the config sweep tool: its --vary A/B (CPU, fast)."""

import dataclasses
import importlib.util
import pathlib
import sys

import pytest

from flash3.kernels.forward import default_config
from flash3.visibility import MaskSpec


# ----------------------------------------------------------------------------
# scripts/tune.py --vary: A/B of config fields at the defaults
# ----------------------------------------------------------------------------

def _script_module(name: str):
  """scripts/<name>.py, imported as a module."""
  path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py"
  spec = importlib.util.spec_from_file_location(f"flash3_{name}_script", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def _tune_module():
  return _script_module("tune")


def test_tune_vary_drops_half_tiles_where_a_variant_cannot_run_them():
  # A window's default takes half edge tiles (128-key tiles); 64-key tiles
  # and the overlapped softmax cannot, so those variants run whole tiles.
  tune = _tune_module()
  cands = tune._vary_candidates("fwd", 128, 16384, True, 1024,
                                tune._parse_vary(["block_kv=64,128"]))
  assert [(c.block_kv, c.half_edge_tiles) for c in cands] == [(64, False), (128, True)]
  cands = tune._vary_candidates("fwd", 128, 16384, True, 1024,
                                tune._parse_vary(["overlap_softmax=0,1"]))
  assert [(c.overlap_softmax, c.half_edge_tiles) for c in cands] == [
      (False, True), (True, False)]


def test_tune_vary_applies_fields_to_the_default_config():
  tune = _tune_module()
  vary = tune._parse_vary(["named_barriers=0,1", "num_stages=2,3"])
  assert vary == {"named_barriers": [False, True], "num_stages": [2, 3]}
  cands = tune._vary_candidates("fwd", 64, 4096, True, None, vary)
  base = default_config(64, "bfloat16", MaskSpec(causal=True, alignment="bottom_right"),
                        4096, 4096)
  assert cands == [dataclasses.replace(base, named_barriers=n, num_stages=s)
                   for n in (False, True) for s in (2, 3)]
  # Configs that do not fit shared memory are left out (D=256, 4 stages).
  assert tune._vary_candidates("fwd", 256, 4096, False, None,
                               tune._parse_vary(["num_stages=2,4"])) == [
      dataclasses.replace(default_config(256, "bfloat16", MaskSpec(), 4096, 4096),
                          num_stages=2)]


def test_tune_vary_drops_fused_delta_where_a_backward_variant_cannot_take_it(capsys):
  # The backward default fuses delta (D <= 128); the single kernel and a dq
  # grid of 64 rows under 128-row dk/dv tiles cannot, so they run without it
  # rather than being skipped. Named, fuse_delta is taken as given.
  tune = _tune_module()
  vary = {"deterministic": [False, True], "block_q_dkv": [64]}
  cands = tune._vary_candidates("bwd", 64, 4096, True, None, vary)
  assert [(c.deterministic, c.fuse_delta) for c in cands] == [(False, False), (True, True)]
  (one,) = tune._vary_candidates("bwd", 64, 4096, True, None, {"compute_wgs_dq": [1]})
  assert (one.compute_wgs_dq, one.block_q_dkv, one.fuse_delta) == (1, 128, False)
  assert not tune._vary_candidates("bwd", 64, 4096, True, None,
                                   {"compute_wgs_dq": [1], "fuse_delta": [True]})
  assert "skipped" in capsys.readouterr().out


def test_tune_variant_is_the_default_plus_fields_set_together():
  # --variant: the default, then the default with a set of fields changed at
  # once (three compute warpgroups need their own registers and ping-pong).
  tune = _tune_module()
  fields = tune._parse_vary(["compute_warpgroups=3", "compute_registers=160",
                             "producer_registers=24", "block_kv=128",
                             "pingpong=handoff"])
  cands = tune._variant_candidates("fwd", 64, 16384, False, None, {}, [fields])
  base = default_config(64, "bfloat16", MaskSpec(), 16384, 16384)
  assert cands == [base, dataclasses.replace(
      base, compute_warpgroups=3, compute_registers=160, producer_registers=24,
      block_kv=128, pingpong="handoff")]
  # A variant equal to the default is not measured twice.
  same = tune._parse_vary([f"block_kv={base.block_kv}"])
  assert tune._variant_candidates("fwd", 64, 16384, False, None, {}, [same]) == [base]


def test_tune_vary_rejects_unknown_fields():
  tune = _tune_module()
  with pytest.raises(SystemExit, match="no_such_field"):
    tune._parse_vary(["no_such_field=1,2"])
  # A backward field for the forward, and the other way round.
  with pytest.raises(SystemExit, match="ForwardConfig"):
    tune._parse_vary(["split_dkv=0,1"], "fwd")
  with pytest.raises(SystemExit, match="BackwardConfig"):
    tune._parse_vary(["named_barriers=0,1"], "bwd")
  assert tune._parse_vary(["overlap_matmuls=0,1"], "bwd") == {
      "overlap_matmuls": [False, True]}


def test_tune_vary_takes_string_fields():
  tune = _tune_module()
  assert tune._parse_vary(["pingpong=handoff, meeting,off"], "fwd") == {
      "pingpong": ["handoff", "meeting", "off"]}
  with pytest.raises(SystemExit, match="handof"):
    tune._parse_vary(["pingpong=handof,off"], "fwd")


# ----------------------------------------------------------------------------
# scripts/tune_ab.py: the A/B table of a --vary run
# ----------------------------------------------------------------------------

def _tune_ab_module():
  return _script_module("tune_ab")


def _row(D, T, mode, ms, cudnn_ms, error=None):
  row = dict(what="fwd", dtype="bfloat16", D=D, T=T, causal=True,
             config=f"ForwardConfig(block_kv=128, pingpong='{mode}', exp2_fma_cols=0)")
  if error:
    return dict(row, error=error)
  return dict(row, ms=ms, cudnn_ms=cudnn_ms, tflops=100.0 / ms,
              cudnn_tflops=100.0 / cudnn_ms, ratio=cudnn_ms / ms)


def test_tune_ab_table_ratios_and_geomean():
  ab = _tune_ab_module()
  rows = [_row(64, 4096, "handoff", 2.0, 1.0), _row(64, 4096, "off", 1.0, 1.0),
          _row(64, 1024, "handoff", 1.0, 1.0), _row(64, 1024, "off", 0.5, 1.0),
          _row(128, 1024, "handoff", 1.0, 1.0),  # "off" missing: not in the mean
          _row(128, 1024, "off", None, None, error="ValueError: boom")]
  text = ab.ab_table(rows, ["pingpong"])
  lines = text.splitlines()
  assert "pingpong=handoff TFLOP/s" in lines[0] and "off / handoff (time)" in lines[0]
  # Shapes in numeric order (T 1024 before 4096); speed of "off" vs "handoff" 2.0.
  assert lines[2].startswith("| fwd | bfloat16 | 64 | 1024 | 1 | - | - | 100 | 200 |")
  assert lines[2].endswith("| 1.000 | 2.000 | 2.000 |")
  assert lines[4].startswith("| fwd | bfloat16 | 128 | 1024 |") and "| - |" in lines[4]
  # Geometric means over the two complete shapes: handoff sqrt(1 * 0.5), off 1 and 2.
  assert "over 2 shapes: pingpong=handoff: 0.707, pingpong=off: 1.414" in text
  assert "error at" in text and "boom" in text


def test_tune_ab_keeps_packed_rows_apart():
  ab = _tune_ab_module()
  rows = [_row(64, 1024, "off", 1.0, 1.0), dict(_row(64, 1024, "off", 0.5, 1.0), docs=8)]
  lines = ab.ab_table(rows, ["pingpong"]).splitlines()
  assert lines[2].startswith("| fwd | bfloat16 | 64 | 1024 | 1 | - | - | 100 |")
  assert lines[3].startswith("| fwd | bfloat16 | 64 | 1024 | 1 | - | 8 | 200 |")


def test_tune_vary_starts_from_the_packed_default():
  # With --docs the base is the config attention_forward picks for packed rows.
  tune = _tune_module()
  vary = tune._parse_vary(["num_stages=2"])
  assert tune._vary_candidates("fwd", 64, 16384, True, None, vary)[0].persistent
  assert not tune._vary_candidates("fwd", 64, 16384, True, None, vary, 8)[0].persistent


def test_tune_docs_must_divide_every_length(monkeypatch, capsys):
  tune = _tune_module()
  monkeypatch.setattr(sys, "argv", ["tune.py", "--docs", "3", "--T", "4096"])
  with pytest.raises(SystemExit):
    tune.main()
  assert "--docs 3" in capsys.readouterr().err


def test_tune_visible_pairs_of_packed_documents():
  tune = _tune_module()
  # Two documents of 4: each sees 4 * 5 / 2 pairs causal, 16 without.
  assert tune._visible_pairs(8, True, None, docs=2) == 20
  assert tune._visible_pairs(8, False, None, docs=2) == 32
  assert tune._visible_pairs(8, True, None) == 32  # FA3's T * T / 2


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 64])
@pytest.mark.parametrize("docs", [None, 4])
def test_tune_counts_flops_as_flash3_bench_does(causal, window, docs):
  """tune.py's TFLOP/s and flash3-bench's are of one FLOP count."""
  from flash3.bench import cases, flops
  tune = _tune_module()
  T, B, N, D = 512, 2, 4, 64
  case = cases.Case("t", B, T, T, N, N, D, causal=causal, num_docs=docs,
                    window=None if window is None else (window, 0 if causal else window))
  assert 4 * B * N * D * tune._visible_pairs(T, causal, window, docs) == (
      flops.forward_flops(case))


def test_tune_ab_unknown_field():
  ab = _tune_ab_module()
  with pytest.raises(SystemExit, match="no_such"):
    ab.ab_table([_row(64, 1024, "off", 1.0, 1.0)], ["no_such"])


def test_hlo_calls_counts_custom_call_targets():
  pytest.importorskip("optax", reason="needs the examples extra")
  hlo_calls = _script_module("hlo_calls")
  mlir = ('%0 = stablehlo.custom_call @mosaic_gpu_v2(%a) : ...\n'
          '%1 = stablehlo.custom_call @mosaic_gpu_v2(%b) : ...\n'
          '%2 = stablehlo.custom_call @cudnn$fmha(%c)\n')
  assert hlo_calls.stablehlo_targets(mlir) == {"mosaic_gpu_v2": 2, "cudnn$fmha": 1}
  hlo = ('%cc = (bf16[2]) custom-call(%x), custom_call_target="mosaic_gpu_v2", api_version=\n'
         '%cd = custom-call(%y), custom_call_target="__cudnn$fmhaSoftmax"\n')
  assert hlo_calls.hlo_targets(hlo) == {"mosaic_gpu_v2": 1, "__cudnn$fmhaSoftmax": 1}


def test_hlo_calls_locates_calls_and_the_pass_that_adds_one(tmp_path):
  pytest.importorskip("optax", reason="needs the examples extra")
  hlo_calls = _script_module("hlo_calls")
  call = '  %{} = (bf16[2]) custom-call(%x), custom_call_target="mosaic_gpu_v2"\n'
  hlo = ("%body.1 (p: (s32[])) -> (s32[]) {\n" + call.format("fwd") + "}\n"
         "%body.2 (p: (s32[])) -> (s32[]) {\n" + call.format("fwd.remat") + call.format("dq")
         + "}\nENTRY %main.3 (a: f32[2]) -> f32[2] {\n  ROOT %w = while(%a)\n}\n")
  assert hlo_calls.calls_by_computation(hlo, "mosaic_gpu_v2") == [
      ("body.1", "fwd"), ("body.2", "fwd.remat"), ("body.2", "dq")]
  for step, name, n in [(0, "start", 2), (1, "cse", 2), (2, "rematerialization", 3),
                        (10, "copy-insertion", 3)]:
    (tmp_path / f"module_0001.jit_step.{step:04d}.gpu.after_{name}.before_x.txt").write_text(
        call * n)
  assert hlo_calls.pass_changes(tmp_path, "mosaic_gpu_v2") == [("rematerialization", 2, 3)]


class _RecordingLock:
  def __init__(self):
    self.held, self.entered = False, 0

  def __enter__(self):
    self.held, self.entered = True, self.entered + 1

  def __exit__(self, *exc):
    self.held = False


@pytest.mark.parametrize("what", ["fwd", "bwd"])
def test_tune_task_runs_on_the_device_only_under_the_lock(monkeypatch, what):
  """Inputs, the backward's forward and every timed call happen while the lock is held
  (another worker's unlocked GPU work would land in this one's timing); compiling
  happens before it. The kernels, cuDNN and CUPTI are stand-ins, so this runs on a CPU."""
  import jax
  import jax.numpy as jnp
  from jax.experimental.mosaic.gpu import profiler
  from flash3.kernels import backward, forward
  tune = _tune_module()
  lock = _RecordingLock()
  monkeypatch.setattr(tune, "_LOCK", lock)
  ran = []

  def on_device(name):
    ran.append((name, lock.held))

  caps = []

  def fake_forward(q, k, v, *, scale, mask, config=None, **seg):
    caps.append(seg.get("softcap"))
    jax.debug.callback(lambda: on_device("forward"))
    B, T, N, _ = q.shape
    return q * scale, jnp.zeros((B, N, T), jnp.float32)

  def fake_backward(q, k, v, o, lse, do, *, scale, mask, config=None, **seg):
    caps.append(seg.get("softcap"))
    jax.debug.callback(lambda: on_device("backward"))
    return q + do, k, v

  def fake_measure(f, iterations=None, aggregate=True):
    def run(*args):
      out = f(*args)
      # A time of one ms per argument tells the calls apart: the backward's 6, cuDNN's
      # forward+backward 4 and forward 3.
      ms = float(len(args))
      return out, ([ms, ms] if aggregate else [("dkv_kernel", 0.6), ("dq_kernel", 0.4)])
    return run

  real_normal = jax.random.normal
  monkeypatch.setattr(jax.random, "normal",
                      lambda *a: (on_device("inputs"), real_normal(*a))[1])
  monkeypatch.setattr(forward, "attention_forward", fake_forward)
  monkeypatch.setattr(backward, "attention_backward", fake_backward)
  monkeypatch.setattr(profiler, "measure", fake_measure)
  monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, k, v, **kw: q)
  # The backward's row with a soft cap (--softcap): it reaches flash3's calls.
  softcap = 30.0 if what == "bwd" else None
  row = tune._task((what, "bfloat16", 64, 128, False, None, None, softcap, None, 2))
  assert "error" not in row, row.get("tb")
  assert caps and set(caps) == {softcap} and row.get("softcap") == softcap
  assert row["ratio"] == pytest.approx(1.0 if what == "fwd" else (4 - 3) / 6)
  names = {name for name, _ in ran}
  assert names == ({"inputs", "forward"} if what == "fwd" else
                   {"inputs", "forward", "backward"})
  assert all(held for _, held in ran), ran
  if what == "bwd":
    assert row["kernels_ms"] == {"dkv_kernel": 0.6, "dq_kernel": 0.4}


def test_tune_backward_sweep_above_128_pits_the_dq_warpgroup_counts():
  """Above head_dim 128 the sweep runs the default (two dq warpgroups where
  they fit, sixteenth session) beside one, and the old two-launch dk/dv; at
  D = 256, where only one fits, no candidate repeats."""
  tune = _tune_module()
  d192 = tune._bwd_candidates(192, causal=True)
  assert d192[0].compute_wgs_dq == 2
  assert {c.compute_wgs_dq for c in d192} == {1, 2}
  assert any(c.split_dkv for c in d192)
  d256 = tune._bwd_candidates(256, causal=False)
  assert all(c.compute_wgs_dq == 1 for c in d256)
  assert len(d256) == len(set(d256))


# ----------------------------------------------------------------------------
# scripts/profile_forward.py: the trace summary
# ----------------------------------------------------------------------------

def _ranges(tid, spans):
  """Chrome-trace B/E events for (name, start, end) spans of one warpgroup."""
  out = []
  for name, b, e in spans:
    out += [dict(name=name, ph="B", ts=b, pid=1, tid=tid),
            dict(name=name, ph="E", ts=e, pid=1, tid=tid)]
  return out


def test_profile_summary_finds_steps_and_item_boundaries():
  prof = _script_module("profile_forward")
  # Compute warpgroup 0 of block 0 (tid 1): two items; steps 10 us apart in
  # each, the second item's first qk 12 us after the first item's last pv.
  events = _ranges(1, [("setup", 0, 1), ("qk", 1, 3), ("pv", 5, 8),
                       ("qk", 11, 13), ("pv", 15, 18), ("epilogue", 18, 26),
                       ("setup", 27, 29), ("qk", 30, 32), ("pv", 34, 37),
                       ("qk", 40, 42), ("pv", 44, 47)])
  # The producer of block 1 (tid 1 + 2 + 3): not a compute warpgroup.
  events += _ranges(6, [("slot_wait", 0, 4), ("slot_wait", 10, 11)])
  text = prof.summarize({"traceEvents": events})
  assert "| compute 0 | epilogue | 8.0 | 1 | 8.000 |" in text
  assert "| producer | slot_wait | 5.0 | 2 | 2.500 |" in text
  assert "median 10.000 kcycles over 2 steps" in text
  assert "median 12.000 kcycles = 1.20 steps, over 1 boundaries" in text


# scripts/compile_report.py: the summary of a Mosaic GPU dump


def test_compile_report_counts_serialised_wgmma_spills_and_hgmma():
  report = _script_module("compile_report")
  log = "\n".join([
      ".visible .entry mosaic_gpu_kernel(",  # PTX is not counted
      "ptxas info    : Used 168 registers, used 16 barriers",
      "ptxas info    : (C7515) Potential Performance Loss: wgmma.mma_async "
      "instructions are serialized due to insufficient register resources",
      "ptxas info    : 0 bytes stack frame, 24 bytes spill stores, 24 bytes spill loads",
      "ptxas info    : Compiling entry function 'mosaic_gpu_kernel'",
      "        /*0a20*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], RZ, !UPT ;",
      "        /*0a30*/   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;",
      "        /*0b00*/   STL.64 [R1+0x8], R2 ;",
      "        /*0b10*/   LDL R4, [R1+0x8] ;",
  ])
  s = report.summarize(log)
  assert s["hgmma"] == 2
  assert s["local"] == 2
  assert len(s["serialized"]) == 1 and "C7515" in s["serialized"][0]
  # Registers, the warning, the spill line and the kernel's name are kept.
  assert len(s["ptxas"]) == 4 and "entry function 'mosaic_gpu_kernel'" in s["ptxas"][3]


def test_compile_report_says_when_a_dump_has_no_sass():
  report = _script_module("compile_report")
  log = "\n".join([
      "//", "// Generated by LLVM NVPTX Back-End", "//", ".visible .entry dq_kernel(",
      "ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem",
      "nvdisasm invocation failed: INTERNAL: Process spawn failed",
      "//", "// Generated by LLVM NVPTX Back-End", "//", ".visible .entry dkv_kernel(",
      "ptxas info    : Used 168 registers, used 16 barriers, 1 bytes smem"])
  s = report.summarize(log)
  assert s["hgmma"] is None and s["local"] is None
  modules = report.ptx_modules(log)
  assert [m.split(".entry ")[1][:3] for m in modules] == ["dq_", "dkv"]
  assert all("ptxas" not in m for m in modules)


def test_compile_report_rejects_a_malformed_case():
  report = _script_module("compile_report")
  assert report.parse_case("bwd:128:4096:1") == ("bwd", 128, 4096, True)
  assert report.parse_case("bwdnd:128:4096:0") == ("bwdnd", 128, 4096, False)
  for bad in ("fwd:128:4096", "dq:64:512:0", "fwd:64:512:2", "fwd:128:abc:1", "fwd:0:512:1"):
    with pytest.raises(ValueError, match=f"case '{bad}' must be what:D:T:causal"):
      report.parse_case(bad)


def test_compile_report_reads_the_offline_dump_sass_and_spills():
  # The offline dump's SASS (.sass_ctrl) prefixes each instruction with its
  # control codes; ptxas names the function that spilled.
  report = _script_module("compile_report")
  log = "\n".join([
      "ptxas warning : Registers are spilled to local memory in function "
      "'dkv_kernel_mosaic_gpu_kernel', 176 bytes spill stores, 184 bytes spill loads",
      "   -:-:-:Y:01        /*0000*/                   LDC R1, c[0x0][0x28] ;",
      "   -:-:1:Y:07        /*0010*/   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;",
      "   -:-:-:Y:01        /*0020*/   STL [R1+0x4], R2 ;",
  ])
  s = report.summarize(log)
  assert s["hgmma"] == 1 and s["local"] == 1
  assert s["spills"] == {"dkv_kernel_mosaic_gpu_kernel": 176}
  assert report.summarize("ptxas info    : Used 168 registers")["spills"] == {}


def test_compile_report_parses_config_overrides():
  report = _script_module("compile_report")
  assert report.parse_overrides(["block_q_dkv=128", "pair_dq=True", "pingpong=handoff"]) == {
      "block_q_dkv": 128, "pair_dq": True, "pingpong": "handoff"}
  with pytest.raises(ValueError, match="'block_q_dkv' must be field=value"):
    report.parse_overrides(["block_q_dkv"])


def test_compile_report_passes_every_override_to_each_case():
  # Each override reaches the case's process as its own --bwd=...; all of them
  # must survive the round trip (a plain nargs list kept only the last).
  report = _script_module("compile_report")
  ap = report.build_parser()
  args = ap.parse_args(["--offline", "--cases", "bwd:128:4096:1", "--bwd",
                        "compute_registers=240", "producer_registers=24", "--fwd", "block_kv=64"])
  cmd = report.case_command("bwd:128:4096:1", args)
  again = ap.parse_args(cmd[2:])
  assert again.run_case == "bwd:128:4096:1" and again.offline
  assert report.parse_overrides(again.bwd) == {"compute_registers": 240, "producer_registers": 24}
  assert report.parse_overrides(again.fwd) == {"block_kv": 64}


def test_compile_report_finds_the_matmul_loops_and_their_spills():
  report = _script_module("compile_report")
  sass = "\n".join([
      ".text.k_mosaic_gpu_kernel:",
      "        /*0000*/   MOV R1, R2 ;",
      ".L_x_1:",
      "        /*0010*/   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;",
      "        /*0020*/   STL [R1+0x4], R2 ;",
      "        /*0030*/   LDL R3, [R1+0x4] ;",
      ".L_x_2:",
      "        /*0040*/   SYNCS.PHASECHK.TRANS64 P0, [UR5], R4 ;",
      "        /*0050*/   @!P0 BRA `(.L_x_2) ;",  # a barrier's retry: no HGMMA
      "        /*0060*/   @P1 BRA `(.L_x_1) ;",  # the matmul loop
      ".L_x_3:",
      "        /*0070*/   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], R24 ;",
      "        /*0080*/   @P2 BRA `(.L_x_3) ;",
      "        /*0090*/   @P3 BRA `(.L_x_1) ;",  # encloses both: left out
  ])
  assert list(report.kernel_sass(sass)) == ["k_mosaic_gpu_kernel"]
  loops = report.matmul_loops(sass)
  assert [(x["start"], x["instructions"], x["hgmma"], x["local"]) for x in loops] == [
      (0x10, 6, 1, 2), (0x70, 2, 1, 0)]


def test_compile_report_leaves_out_a_retry_branch_back_into_a_loop():
  report = _script_module("compile_report")
  sass = "\n".join([
      ".text.k_mosaic_gpu_kernel:",
      ".L_x_1:",
      "        /*0000*/   HGMMA.64x64x16.F32.BF16 R24, gdesc[UR4], RZ ;",
      ".L_x_2:",
      "        /*0010*/   SYNCS.PHASECHK.TRANS64 P0, [UR5], R4 ;",
      "        /*0020*/   @P1 BRA `(.L_x_1) ;",
      "        /*0030*/   @!P0 BRA `(.L_x_2) ;",  # from past the loop back into it
  ])
  assert [x["start"] for x in report.matmul_loops(sass)] == [0]


def test_compile_report_refuses_bad_overrides_before_compiling():
  # Every config is built in the parent first: an unknown field names the
  # fields there are, a bad value the case, the override and the base config.
  report = _script_module("compile_report")
  with pytest.raises(ValueError, match="--bwd no_such_field: BackwardConfig has no such "
                                       "field; its fields are .*block_q_dkv"):
    report.case_configs("bwd:128:4096:1", {}, {"no_such_field": 1})
  with pytest.raises(ValueError, match=r"case bwd:128:4096:1 with --bwd block_q_dkv=7: "
                                       r"block_q_dkv=7 .*the heuristic's config there"):
    report.case_configs("bwd:128:4096:1", {}, {"block_q_dkv": 7})
  fwd, bwd = report.case_configs("bwd:128:4096:1", {}, {"compute_registers": 240,
                                                        "producer_registers": 24})
  assert bwd.compute_registers == 240 and bwd.producer_registers == 24 and fwd is not None
  assert report.case_configs("fwd:128:4096:1", {"block_kv": 128}, {})[1] is None


def test_compile_report_case_options():
  report = _script_module("compile_report")
  assert report.parse_case("bwd:64:4096:0:window+softcap") == ("bwd", 64, 4096, False)
  assert report.case_options("bwd:64:4096:0:window+softcap") == ("window", "softcap")
  assert report.case_options("fwd:64:4096:0") == ()
  mask = report.case_mask("fwd:64:4096:1:window")
  assert (mask.causal, mask.window_left) == (True, 1024)
  assert report.case_mask("fwd:64:4096:0:window").window_right == 1024
  with pytest.raises(ValueError, match="option 'bias' is not one of window, lengths"):
    report.parse_case("fwd:64:4096:0:bias")
