"""Compare two train_gpt runs (e.g. flash3 and cuDNN from the same seed): one plot, one table.

  python -m examples.train_gpt.compare RUN_A/log.json RUN_B/log.json --out DIR

Writes DIR/compare.png (train loss, held-out loss, and the per-step difference of train
loss) and DIR/compare.md (tokens/s, step time, attention share, final losses, the largest
train-loss difference), and prints the table.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import numpy as np


def load(path) -> dict:
  log = json.loads(pathlib.Path(path).read_text())
  log["name"] = log["args"]["attention"]
  return log


def name_runs(logs: list[dict], paths: list[str]) -> None:
  """Two runs of the same attention path are told apart by their folders."""
  if logs[0]["name"] == logs[1]["name"]:
    paths = [pathlib.Path(x).resolve() for x in paths]
    # The folders (run1/log.json, run2/log.json), or the files when they share one.
    tags = ([x.parent.name for x in paths] if paths[0].parent != paths[1].parent
            else [x.stem for x in paths])
    for log, tag in zip(logs, tags):
      log["name"] = f"{log['name']} ({tag})"


def share_text(attention_time: dict) -> str:
  """"32%", or "noise" when the share's 95% interval reaches 0 (small models,
  busy CPUs), or "n/a" when not measured."""
  if not attention_time:
    return "n/a"
  lo = attention_time.get("attention_share_ci95", [1.0, 1.0])[0]
  if lo <= 0:
    return "noise"
  return f"{100 * attention_time['attention_share']:.0f}%"


def table(logs: list[dict]) -> str:
  rows = ["| run | attention path | tokens/s | median step (s) | attention share of step | "
          "first -> final held-out loss | final train loss |", "|---|---|---|---|---|---|---|"]
  for log in logs:
    s = log.get("summary", {})
    share = share_text(s.get("attention_time", {}))
    rows.append(
        f"| {log['name']} | {log['attention']} | {s.get('tokens_per_s', float('nan')):,.0f} | "
        f"{s.get('median_step_s', float('nan')):.4f} | {share} | "
        f"{s.get('first_heldout_loss', float('nan')):.3f} -> "
        f"{s.get('final_heldout_loss', float('nan')):.3f} | "
        f"{s.get('final_train_loss', float('nan')):.3f} |")
  return "\n".join(rows)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("logs", nargs=2)
  p.add_argument("--out", required=True)
  args = p.parse_args(argv)
  out = pathlib.Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  logs = [load(x) for x in args.logs]
  name_runs(logs, args.logs)

  a, b = ({r["step"]: r["train_loss"] for r in log["steps"]} for log in logs)
  common = sorted(set(a) & set(b))
  diff = np.array([a[s] - b[s] for s in common])
  lines = [table(logs), ""]
  if common:
    lines.append(f"train loss {logs[0]['name']} - {logs[1]['name']} over {len(common)} steps: "
                 f"max |diff| {np.max(np.abs(diff)):.4f}, mean diff {np.mean(diff):+.4f}, "
                 f"last 50 steps mean |diff| {np.mean(np.abs(diff[-50:])):.4f}")
  for log in logs:
    for w in log.get("warnings", []):
      lines.append(f"warning in the {log['name']} run: {w}")
  text = "\n".join(lines) + "\n"
  (out / "compare.md").write_text(text)
  print(text)

  import matplotlib  # noqa: PLC0415
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # noqa: PLC0415
  fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                    gridspec_kw={"height_ratios": [3, 1]})
  for log in logs:
    tps = log.get("summary", {}).get("tokens_per_s", float("nan"))
    line, = ax.plot([r["step"] for r in log["steps"]], [r["train_loss"] for r in log["steps"]],
                    lw=0.8, alpha=0.7, label=f"{log['name']} train ({tps:,.0f} tokens/s)")
    ax.plot([r["step"] for r in log["heldout"]], [r["heldout_loss"] for r in log["heldout"]],
            "o--", color=line.get_color(), label=f"{log['name']} held-out")
  ax.set_ylabel("next-byte loss (nats)")
  ax.set_title(f"same seed, {logs[0]['device']}", fontsize=9)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=8)
  ax_diff.plot(common, diff, lw=0.8)
  ax_diff.axhline(0, color="k", lw=0.5)
  ax_diff.set_ylabel(f"{logs[0]['name']} - {logs[1]['name']}")
  ax_diff.set_xlabel("step")
  ax_diff.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(out / "compare.png", dpi=120, bbox_inches="tight")
  plt.close(fig)


if __name__ == "__main__":
  main()
