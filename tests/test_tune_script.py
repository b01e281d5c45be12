"""scripts/tune.py, the config sweep tool: its --vary A/B (CPU, fast)."""

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
  cands = tune._vary_candidates("fwd", 128, 4096, True, None, vary)
  base = default_config(128, "bfloat16", MaskSpec(causal=True, alignment="bottom_right"),
                        4096, 4096)
  assert len(cands) == 4
  assert {(c.named_barriers, c.num_stages) for c in cands} == {
      (False, 2), (False, 3), (True, 2), (True, 3)}
  # Every other field is the default's.
  assert all(c.reverse_q_tiles == base.reverse_q_tiles and c.block_kv == base.block_kv
             for c in cands)


def test_tune_vary_rejects_unknown_fields():
  tune = _tune_module()
  with pytest.raises(SystemExit, match="no_such_field"):
    tune._parse_vary(["no_such_field=1,2"])
