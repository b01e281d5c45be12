"""scripts/tune.py, the config sweep tool: its --vary A/B (CPU, fast)."""

import dataclasses
import importlib.util
import pathlib

import pytest

from flash3.kernels.forward import default_config
from flash3.visibility import MaskSpec


# ----------------------------------------------------------------------------
# scripts/tune.py --vary: A/B of config fields at the defaults
# ----------------------------------------------------------------------------

def _tune_module():
  path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "tune.py"
  spec = importlib.util.spec_from_file_location("flash3_tune_script", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


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
