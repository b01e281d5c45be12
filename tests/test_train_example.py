"""The train_gpt example on the CPU: data split, packing, a few tiny steps, exact resume."""

import json
import pathlib
import sys

import numpy as np
import pytest

pytest.importorskip("optax", reason="needs the examples extra: FLASH3_EXTRAS=examples")
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from examples.train_gpt import attention as attention_lib  # noqa: E402
from examples.train_gpt import data as data_lib  # noqa: E402
from examples.train_gpt import train as train_lib  # noqa: E402

TINY = ["--preset", "cpu", "--attention", "xla", "--num-layers", "1", "--num-heads", "2",
        "--num-kv-heads", "1", "--head-dim", "64", "--mlp-dim", "128", "--seq-len", "64",
        "--batch-size", "4", "--lr", "1e-2", "--warmup", "2", "--eval-batches", "2",
        "--max-train-bytes", "300000", "--attention-share-steps", "0", "--no-progress"]


def test_split_by_file_has_no_overlap():
  root = data_lib.stdlib_root()
  files = data_lib.stdlib_files(root)
  train, heldout = data_lib.split_files(files, root, heldout_percent=5)
  assert len(train) + len(heldout) == len(files)
  assert heldout and len(heldout) < len(train)
  assert not set(train) & set(heldout)
  # The split depends only on the relative path, so every machine splits alike.
  again_train, again_heldout = data_lib.split_files(list(reversed(files)), root, 5)
  assert set(again_heldout) == set(heldout)
  assert all(p.suffix == ".py" and "site-packages" not in p.parts for p in files)


def test_packing_marks_document_boundaries(tmp_path):
  (tmp_path / "a.py").write_bytes(b"A" * 300)
  (tmp_path / "b.py").write_bytes(b"B" * 300)
  stream = data_lib.build_stream(data_lib.stdlib_files(tmp_path), tmp_path)
  assert stream.files == ("a.py", "b.py")
  batch = data_lib.batch_at(stream, np.array([290, 0]), seq_len=16)
  row = batch.inputs[0]
  # Positions 0..9 are the end of a.py, 10..15 the start of b.py.
  np.testing.assert_array_equal(row, [65] * 10 + [66] * 6)
  np.testing.assert_array_equal(batch.segment_ids[0], [1] * 10 + [2] * 6)
  np.testing.assert_array_equal(batch.targets[0], [65] * 9 + [66] * 7)
  # The target of position 9 (last byte of a.py) is in b.py: not a next-byte target.
  np.testing.assert_array_equal(batch.loss_mask[0], [1] * 9 + [0] + [1] * 6)
  np.testing.assert_array_equal(batch.segment_ids[1], [1] * 16)
  assert batch.loss_mask[1].all()


def test_cudnn_packed_lengths_and_offsets():
  seg = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
  seqlen, offsets = attention_lib._packed_lengths_offsets(seg, max_segments=4)
  np.testing.assert_array_equal(seqlen, [[3, 2, 3, -1], [8, -1, -1, -1]])
  np.testing.assert_array_equal(offsets, [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]])


def test_cudnn_packed_layout_pairs_every_segment_with_its_start():
  # What jax's cuDNN wrapper makes of our arrays: one list of segment lengths and one of
  # global token offsets, which must pair up (an end marker per row shifted later rows).
  from jax._src.cudnn import fused_attention_stablehlo as cudnn_fa
  seg = jnp.array([[1, 1, 1, 2, 2, 3, 3, 3], [1, 1, 1, 1, 2, 2, 2, 2],
                   [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
  seqlen, offsets = attention_lib._packed_lengths_offsets(seg, max_segments=4)
  B, T, N, K, D = 3, 8, 1, 1, 1
  x = jnp.zeros((B, T, N, D))
  lens, _, offs, _ = cudnn_fa._fix_seqlen_offsets(seqlen, seqlen, offsets, offsets, x, x)
  lens, offs = np.asarray(lens).ravel(), np.asarray(offs).ravel()
  np.testing.assert_array_equal(lens[:6], [3, 2, 3, 4, 4, 8])
  np.testing.assert_array_equal(offs[:6], [0, 3, 5, 8, 12, 16])
  # Each segment ends where the next one starts, and the last one at B * T.
  np.testing.assert_array_equal(offs[:5] + lens[:5], offs[1:6])
  assert offs[5] + lens[5] == B * T


def _losses(out):
  log = json.loads((out / "log.json").read_text())
  return [r["train_loss"] for r in log["steps"]], log


def test_tiny_training_loss_goes_down(tmp_path):
  train_lib.main(TINY + ["--steps", "30", "--eval-every", "30", "--out", str(tmp_path)])
  losses, log = _losses(tmp_path)
  assert [r["step"] for r in log["steps"]] == list(range(1, 31))
  assert np.mean(losses[-5:]) < losses[0] - 1.0, losses
  assert log["heldout"][-1]["heldout_loss"] < log["heldout"][0]["heldout_loss"] - 1.0
  assert log["summary"]["tokens_per_s"] > 0
  assert (tmp_path / "loss.png").stat().st_size > 0


def test_resume_continues_at_the_right_step_with_identical_results(tmp_path):
  common = TINY + ["--steps", "6", "--eval-every", "3", "--checkpoint-every", "3"]
  straight, broken = tmp_path / "straight", tmp_path / "broken"
  train_lib.main(common + ["--out", str(straight)])
  # Interrupted after step 4: the checkpoint holds step 3, so step 4 is taken again.
  train_lib.main(common + ["--out", str(broken), "--stop-at", "4"])
  train_lib.main(common + ["--out", str(broken), "--resume"])
  a, log_a = _losses(straight)
  b, log_b = _losses(broken)
  assert [r["step"] for r in log_b["steps"]] == list(range(1, 7))
  assert a == b  # bit-identical on the CPU
  assert log_a["heldout"] == log_b["heldout"]
  with np.load(straight / "checkpoint.npz") as fa, np.load(broken / "checkpoint.npz") as fb:
    assert int(fa["step"]) == int(fb["step"]) == 6
    for name in fa.files:
      np.testing.assert_array_equal(fa[name], fb[name], err_msg=name)


def test_flash3_switch_matches_xla_on_cpu():
  # On the CPU flash3 runs its XLA path: the same loss as the XLA switch, to bf16 noise.
  import jax  # noqa: PLC0415
  from examples.train_gpt import model as model_lib  # noqa: PLC0415
  stream = data_lib.build_stream(data_lib.stdlib_files(data_lib.stdlib_root())[:20],
                                 data_lib.stdlib_root())
  batch = train_lib.to_device(data_lib.train_batch(stream, 1, 2, 128, 0))
  cfg = model_lib.Config(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=64, mlp_dim=128)
  params = model_lib.init_params(cfg, jax.random.key(0))
  losses = {}
  for impl in ("flash3", "xla"):
    c = model_lib.Config(**{**cfg.__dict__, "attention": impl})
    losses[impl] = float(model_lib.loss_fn(c, params, batch))
  assert abs(losses["flash3"] - losses["xla"]) < 2e-2, losses
  assert 5.0 < losses["xla"] < 6.0  # ~ln(256) at initialisation


def test_crosscheck_evaluates_one_checkpoint_with_each_path(tmp_path, capsys):
  from examples.train_gpt import crosscheck  # noqa: PLC0415
  with pytest.raises(SystemExit, match="no checkpoint.npz"):
    crosscheck.main(TINY + ["--out", str(tmp_path / "none")])
  train_lib.main(TINY + ["--steps", "4", "--eval-every", "4", "--out", str(tmp_path)])
  trained = json.loads((tmp_path / "log.json").read_text())["heldout"][-1]["heldout_loss"]
  out = tmp_path / "crosscheck.json"
  result = crosscheck.main(TINY + ["--out", str(tmp_path), "--impls", "xla,flash3",
                                   "--json", str(out)])
  assert result["step"] == 4 and json.loads(out.read_text()) == result
  rows = {r["attention"]: r for r in result["results"]}
  # The trainer's own held-out loss of these parameters, recomputed by the XLA path.
  assert rows["xla"]["heldout_loss"] == pytest.approx(trained, abs=1e-6)
  assert rows["xla"]["diff_vs_first"] == 0.0 and len(rows["xla"]["per_batch"]) == 2
  assert 0 < rows["flash3"]["heldout_loss"] < 6
  assert abs(rows["flash3"]["diff_vs_first"]) < 1e-3
  # The gradients: identical to themselves, and flash3's XLA path close to XLA's.
  assert rows["xla"]["grad_rel_diff_vs_first"] == 0.0
  assert rows["xla"]["grad_cosine_vs_first"] == pytest.approx(1.0)
  assert 0 < rows["flash3"]["grad_rel_diff_vs_first"] < 0.05
  assert rows["flash3"]["grad_cosine_vs_first"] > 0.999
  assert "| flash3 |" in capsys.readouterr().out


def test_one_hot_embedding_and_pick_equal_the_gather():
  # The model embeds by a one-hot matmul (its gradient is a matmul, not a
  # scatter-add): bitwise the gather's values, and the gather's gradient.
  from examples.train_gpt import model as model_lib  # noqa: PLC0415
  kt, ki, kg = jax.random.split(jax.random.key(1), 3)
  table = jax.random.normal(kt, (256, 48), jnp.float32).astype(jnp.bfloat16)
  inputs = jax.random.randint(ki, (3, 40), 0, 256)
  np.testing.assert_array_equal(np.asarray(model_lib.embed(table, inputs), np.float32),
                                np.asarray(table[inputs], np.float32))
  g = jax.random.normal(kg, (3, 40, 48), jnp.float32)
  grad = lambda f: jax.grad(lambda t: jnp.sum(f(t).astype(jnp.float32) * g))(  # noqa: E731
      table.astype(jnp.float32))
  np.testing.assert_allclose(grad(lambda t: model_lib.embed(t, inputs)),
                             grad(lambda t: t[inputs]), rtol=1e-5, atol=1e-5)
  logp = jax.nn.log_softmax(jax.random.normal(kt, (3, 40, 256)), axis=-1)
  np.testing.assert_array_equal(
      model_lib.pick(logp, inputs),
      jnp.take_along_axis(logp, inputs[..., None], axis=-1)[..., 0])


def test_timeline_summary_of_kernel_events():
  from examples.train_gpt import timeline  # noqa: PLC0415
  events = [(0, 10_000, "a", "Stream #1"), (5_000, 20_000, "b", "Stream #1"),
            (30_000, 40_000, "a", "Stream #1"), (90_000, 100_000, "c", "Stream #2"),
            (100_000, 100_000, "MemcpyDtoD", "Stream #2")]
  s = timeline.summarize(events)
  assert s["kernels"] == 4 and s["copies"] == 1 and s["streams"] == 2
  assert s["span_ms"] == pytest.approx(0.1)
  assert s["busy_ms"] == pytest.approx(0.04)  # 0-20, 30-40, 90-100 us
  assert s["idle_ms"] == pytest.approx(0.06)
  assert s["gaps_over_10us"] == 1 and s["idle_in_gaps_over_10us_ms"] == pytest.approx(0.05)
  assert s["largest_gaps"][0] == {"us": 50.0, "after": "a", "before": "c"}
  assert s["kernel_ms_by_name"][0] == {"name": "a", "ms": pytest.approx(0.02), "count": 2}
  assert timeline.summarize([]) == {"kernels": 0, "copies": 0}
  # An event inside a longer one: busy is the union, the gap follows the long one.
  nested = [(0, 30_000, "long", "Stream #1"), (5_000, 10_000, "short", "Stream #2"),
            (40_000, 50_000, "x", "Stream #1")]
  s = timeline.summarize(nested)
  assert s["busy_ms"] == pytest.approx(0.04) and s["idle_ms"] == pytest.approx(0.01)
  assert s["largest_gaps"][0] == {"us": 10.0, "after": "long", "before": "x"}


def test_cudnn_without_a_gpu_says_so():
  with pytest.raises(SystemExit, match="--attention cudnn needs an NVIDIA GPU; the "
                     "default device is a cpu"):
    train_lib.check_attention_device("cudnn", "cpu")
  train_lib.check_attention_device("cudnn", "gpu")
  train_lib.check_attention_device("flash3", "cpu")
  with pytest.raises(SystemExit, match="--flash3-kernels-only needs a Hopper GPU .*cpu"):
    train_lib.check_attention_device("flash3", "cpu", kernels_only=True)


def test_speed_times_implementations_side_by_side(tmp_path, capsys):
  from examples.train_gpt import speed  # noqa: PLC0415
  sizes = [a for a in TINY if a not in ("--attention", "xla")]
  out = tmp_path / "speed.json"
  result = speed.main(sizes + ["--impls", "xla,flash3", "--steps", "2", "--json", str(out)])
  assert json.loads(out.read_text()) == result
  rows = {r["attention"]: r for r in result["results"]}
  assert list(rows) == ["xla", "flash3"]
  assert rows["xla"]["speed_vs_first"] == 1.0
  for r in rows.values():
    assert 0 < r["min_step_s"] <= r["median_step_s"] <= r["max_step_s"]
    assert r["tokens_per_s"] == pytest.approx(4 * 64 / r["median_step_s"])
    lo, hi = r["paired_speed_ci95"]
    assert lo <= r["paired_speed_vs_first"] <= hi
    if jax.devices()[0].platform == "gpu":  # CUPTI: each step's kernel time
      assert r["kernel_ms_median"] > 0
      lo, hi = r["kernel_speed_ci95"]
      assert lo <= r["kernel_speed_vs_first"] <= hi
    else:
      assert "kernel_ms_median" not in r
  assert rows["xla"]["paired_speed_vs_first"] == 1.0
  assert "| flash3 |" in capsys.readouterr().out


def test_alternate_timing_flips_the_order_every_round():
  calls = []
  fns = {name: (lambda state, batch, name=name: calls.append(name) or state)
         for name in ("a", "b", "c")}
  times = train_lib.time_alternately(fns, 0, None, 3)
  assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3, "c": 3}
  # One untimed warm-up call each, then a b c / c b a / a b c.
  assert calls == list("abc") + list("abc") + list("cba") + list("abc")


def test_paired_speed_is_the_median_of_per_round_ratios():
  from examples.train_gpt import train as train_lib  # noqa: PLC0415
  base = [1.0, 2.0, 1.0, 4.0, 1.0]
  other = [0.5, 2.0, 2.0, 2.0, 1.0]  # ratios 2, 1, 0.5, 2, 1
  paired, lo, hi = train_lib.paired_speed(base, other)
  assert paired == 1.0
  assert 0.5 <= lo <= 1.0 <= hi <= 2.0
  # A steady 10% gain is found however much the rounds drift together.
  drift = np.linspace(1.0, 1.5, 40)
  paired, lo, hi = train_lib.paired_speed(list(1.1 * drift), list(drift))
  assert paired == pytest.approx(1.1) and lo == pytest.approx(1.1) and hi == pytest.approx(1.1)


@pytest.mark.parametrize("argv", [["--impls", "flash3,nope"], ["--impls", ""], ["--steps", "0"]])
def test_speed_rejects_bad_arguments(argv):
  from examples.train_gpt import speed  # noqa: PLC0415
  with pytest.raises(SystemExit) as info:
    speed.parse_args(argv)
  assert info.value.code == 2


@pytest.mark.parametrize("argv,named", [
    (["--seq-len", "0"], "--seq-len=0"), (["--steps", "-1"], "--steps=-1"),
    (["--warmup", "-2"], "--warmup=-2"), (["--lr", "0"], "--lr=0.0"),
    (["--num-heads", "3", "--num-kv-heads", "2"], "--num-heads=3"),
    (["--max-train-bytes", "0"], "--max-train-bytes=0")])
def test_trainer_rejects_bad_sizes_naming_them(argv, named, capsys):
  # A fresh-user review: --seq-len 0 "trained" to a held-out loss of 0.000.
  with pytest.raises(SystemExit) as info:
    train_lib.parse_args(argv)
  assert info.value.code == 2
  assert named in capsys.readouterr().err


@pytest.mark.parametrize("text", ["flash3,nope", "", " , "])
def test_crosscheck_rejects_bad_impls_naming_the_allowed(text, capsys):
  from examples.train_gpt import crosscheck  # noqa: PLC0415
  with pytest.raises(SystemExit) as info:
    crosscheck.parse_args(["--impls", text])
  assert info.value.code == 2
  assert "allowed: flash3, cudnn, xla" in capsys.readouterr().err


def test_resume_without_a_checkpoint_says_so_and_share_has_an_interval(tmp_path, capsys):
  args = [a for a in TINY if a not in ("--attention-share-steps", "0")]
  log = train_lib.main(args + ["--steps", "2", "--eval-every", "2", "--resume",
                               "--attention-share-steps", "3", "--out", str(tmp_path)])
  assert f"no checkpoint at {tmp_path / 'checkpoint.npz'}; starting from step 0" in (
      capsys.readouterr().err)
  assert [r["step"] for r in log["steps"]] == [1, 2]
  at = log["summary"]["attention_time"]
  lo, hi = at["attention_share_ci95"]
  assert lo <= at["attention_share"] <= hi < 1


def test_attention_share_and_its_interval_from_paired_rounds():
  rng = np.random.default_rng(0)
  drift = 1.0 + 0.3 * rng.random(40)  # load that hits both steps of a round alike
  full = list(0.100 * drift * (1 + 0.01 * rng.standard_normal(40)))
  replaced = list(0.068 * drift * (1 + 0.01 * rng.standard_normal(40)))
  share, lo, hi = train_lib.attention_share(full, replaced)
  assert share == pytest.approx(0.32, abs=0.01)
  assert 0 < lo <= share <= hi < 0.34
  # No difference: the interval reaches 0.
  _, lo, hi = train_lib.attention_share(full, full)
  assert lo <= 0 <= hi


def test_compare_names_two_runs_of_one_path_by_folder_and_shows_noise():
  from examples.train_gpt import compare  # noqa: PLC0415
  logs = [{"name": "flash3"}, {"name": "flash3"}]
  compare.name_runs(logs, ["/x/run1/log.json", "/x/run2/log.json"])
  assert [g["name"] for g in logs] == ["flash3 (run1)", "flash3 (run2)"]
  same = [{"name": "flash3"}, {"name": "flash3"}]
  compare.name_runs(same, ["/x/flash3-log.json", "/x/flash3-rerun-log.json"])
  assert [g["name"] for g in same] == ["flash3 (flash3-log)", "flash3 (flash3-rerun-log)"]
  other = [{"name": "flash3"}, {"name": "cudnn"}]
  compare.name_runs(other, ["/x/a/log.json", "/x/b/log.json"])
  assert [g["name"] for g in other] == ["flash3", "cudnn"]
  assert compare.share_text({}) == "n/a"
  assert compare.share_text({"attention_share": 0.32,
                             "attention_share_ci95": [0.30, 0.33]}) == "32%"
  assert compare.share_text({"attention_share": 0.05,
                             "attention_share_ci95": [-0.02, 0.09]}) == "noise"
  # Logs written before the interval existed keep their figure.
  assert compare.share_text({"attention_share": 0.31}) == "31%"


def test_checkpoint_of_another_model_names_the_flags(tmp_path):
  from examples.train_gpt import checkpoint  # noqa: PLC0415
  checkpoint.save(tmp_path / "c.npz", {"w": jnp.zeros((2, 3))}, 1)
  with pytest.raises(ValueError, match=r"\(2, 3\) float32, expected \(3, 3\).*--num-layers"):
    checkpoint.restore(tmp_path / "c.npz", {"w": jnp.zeros((3, 3))})
