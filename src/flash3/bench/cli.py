"""The command line of ``flash3-bench`` (also ``python -m flash3.bench``).

Exit status: 0 after a run (whatever the rows say), 1 without a Hopper GPU,
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

from flash3.bench import cases as cases_lib
from flash3.bench.cases import DTYPES, MODES, Case

QUICK_ITERATIONS = 5


def _positive_int(text: str) -> int:
  try:
    value = int(text)
  except ValueError:
    value = 0
  if value < 1:
    raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
  return value


def _positive_seconds(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = 0.0
  if not value > 0:  # Also refuses nan; 0 would run no case and exit 0.
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected a number of seconds > 0")
  return value


def _ints(text: str) -> tuple[int, ...]:
  try:
    return tuple(int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"{text!r}: expected comma-separated integers") from None


def _csv(choices: tuple[str, ...] | None = None):
  def parse(text: str) -> tuple[str, ...]:
    items = tuple(x.strip() for x in text.split(",") if x.strip())
    if not items:
      raise argparse.ArgumentTypeError("expected a comma-separated list")
    if choices is not None:
      bad = [x for x in items if x not in choices]
      if bad:
        raise argparse.ArgumentTypeError(
            f"{', '.join(bad)} not in {', '.join(choices)}")
    return items
  return parse


def _window(text: str) -> tuple[int, int]:
  """"LEFT,RIGHT" -> (LEFT, RIGHT); one int W means (W, W), as in jax.nn."""
  try:
    parts = [int(x) for x in text.split(",")]
  except ValueError:
    parts = []
  if len(parts) not in (1, 2):
    raise argparse.ArgumentTypeError(
        f"--window {text!r}: expected LEFT,RIGHT or W (ints)")
  left, right = parts if len(parts) == 2 else parts * 2
  if left < 0 or right < 0:
    raise argparse.ArgumentTypeError(f"--window {text!r}: must be >= 0")
  return left, right


def _lengths(text: str) -> tuple[int, ...]:
  try:
    lengths = tuple(int(x) for x in text.split(","))
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"--lengths {text!r}: expected comma-separated ints, one per batch "
        f"row, e.g. 4096,3072,2048,1024") from None
  if min(lengths) < 1:
    raise argparse.ArgumentTypeError(f"--lengths {text!r}: must be >= 1")
  return lengths


def _shard(text: str) -> tuple[int, int]:
  try:
    index, count = (int(x) for x in text.split("/"))
  except ValueError:
    index, count = -1, 0
  if count < 1 or not 0 <= index < count:
    raise argparse.ArgumentTypeError(
        f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/2")
  return index, count


SHAPE_KEYS = ("B", "T", "Tq", "Tk", "N", "K", "D")


def parse_shape(text: str) -> dict[str, int]:
  """"B=2,T=4096,N=32,K=8,D=128" -> sizes. T sets Tq and Tk; K defaults to N.

  Raises:
    argparse.ArgumentTypeError: for unknown or repeated keys, T with Tq or Tk,
      non-integers or missing B, N, D or lengths.
  """
  sizes = {}
  for item in text.split(","):
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or key not in SHAPE_KEYS:
      raise argparse.ArgumentTypeError(
          f"--shape item {item!r}: expected KEY=INT with KEY in "
          f"{', '.join(SHAPE_KEYS)}")
    if key in sizes:
      raise argparse.ArgumentTypeError(
          f"--shape {text!r} gives {key} twice; allowed: each key once")
    try:
      sizes[key] = int(value)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"--shape item {item!r}: {value!r} is not an int") from None
  both = [k for k in ("Tq", "Tk") if k in sizes]
  if "T" in sizes and both:  # T sets Tq and Tk: which one would win?
    raise argparse.ArgumentTypeError(
        f"--shape {text!r} gives T and {' and '.join(both)}; allowed: T (both "
        "lengths) or Tq and Tk, not both")
  if "T" in sizes:
    sizes["Tq"] = sizes["Tk"] = sizes["T"]
  missing = [k for k in ("B", "Tq", "Tk", "N", "D") if k not in sizes]
  if missing:
    raise argparse.ArgumentTypeError(
        f"--shape {text!r} lacks {', '.join(missing)}")
  sizes.setdefault("K", sizes["N"])
  return sizes


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="flash3-bench",
      description="Benchmark flash3 against cuDNN, XLA, jax's FA3 and "
                  "tokamax on a Hopper GPU: table, CSV/JSON and PNG plots.")
  p.add_argument("--suite", default=None,
                 choices=sorted(cases_lib.SUITES) + ["all"],
                 help="which shapes (default fa3; all = fa3 gqa long masks)")
  p.add_argument("--quick", action="store_true",
                 help="a few shapes, 5 iterations, no block-size search: "
                      "under two minutes")
  p.add_argument("--shape", type=parse_shape, default=None,
                 help='one shape instead of a suite (so not with --suite, '
                      '--quick, --seqlens, --head-dims), e.g. '
                      '"B=2,T=4096,N=32,K=8,D=128" (Tq=, Tk= for unequal); '
                      'one case per --dtypes entry')
  p.add_argument("--causal", action="store_true", help="with --shape")
  p.add_argument("--window", type=_window, default=None,
                 help="with --shape: local window LEFT,RIGHT (inclusive) or W for W,W")
  p.add_argument("--docs", type=_positive_int, default=None,
                 help="with --shape: packed documents of equal length per row")
  p.add_argument("--lengths", type=_lengths, default=None, metavar="L1,L2,...",
                 help="with --shape (Tq == Tk): valid length of each batch "
                      "row, queries and keys alike (right padding)")
  p.add_argument("--dtypes", type=_csv(DTYPES), default=None,
                 help="comma-separated subset of float16,bfloat16 "
                      "(default: the suite's)")
  p.add_argument("--seqlens", type=_ints, default=None,
                 help="keep only the suite's cases with these query lengths, "
                      "e.g. 4096,16384")
  p.add_argument("--head-dims", type=_ints, default=None,
                 help="keep only the suite's cases with these head dims, e.g. 128")
  p.add_argument("--shard", type=_shard, default=None, metavar="I/N",
                 help="run only shard I (0-based) of N: a similar mix of the "
                      "selected cases for each, to run side by side on N GPUs "
                      "(CUDA_VISIBLE_DEVICES) or in N calls; combine the "
                      "outputs with --merge")
  p.add_argument("--skip-done", nargs="+", default=None, metavar="RESULTS",
                 help="skip the cases that already have a row for every "
                      "contender and mode in these results.json files or "
                      "--out directories (of a run that was cut off); "
                      "combine the outputs with --merge")
  p.add_argument("--impls", type=_csv(), default=None,
                 help="comma-separated contenders (default: flash3, cudnn, xla, "
                      "jax-mgpu, tokamax); also cudnn-det (cuDNN's deterministic "
                      "backward) and flash3-nondet (deterministic=False)")
  p.add_argument("--modes", type=_csv(MODES), default=MODES,
                 help="fwd and/or fwd+bwd (bwd is derived from both)")
  p.add_argument("--iterations", type=int, default=None,
                 help="timed runs per measurement (default 10, quick 5)")
  p.add_argument("--warmup", type=int, default=2, help="untimed runs first")
  p.add_argument("--no-tune", action="store_true",
                 help="one block size per contender instead of the best")
  p.add_argument("--compile-jobs", type=_positive_int, default=8, metavar="N",
                 help="compile a case's functions N at a time in threads "
                      "before checking and timing them one by one, alone on "
                      "the GPU (default 8; 1 compiles each just before it "
                      "runs, keeping one executable at a time)")
  p.add_argument("--interleave", type=int, default=None, metavar="ROUNDS",
                 help="time a case's contenders in ROUNDS turns, each taking "
                      "ceil(iterations / ROUNDS) runs per turn, in order on "
                      "even turns and reversed on odd ones, so a GPU clock "
                      "that drifts during a case slows them alike (ROUNDS in "
                      "[1, iterations], best even; needs --compile-jobs >= 2). "
                      "Default: one run per turn (ROUNDS = iterations), or 0 "
                      "with --compile-jobs 1; 0 times each contender's runs "
                      "in one block (on an H200 that favoured whichever "
                      "contender ran first by up to 6%%, seventeenth session)")
  p.add_argument("--out", default="bench-results",
                 help="directory for results.json, results.csv, table.txt, "
                      "summary.md and plots/ (default ./bench-results)")
  p.add_argument("--no-plots", action="store_true")
  p.add_argument("--time-budget", type=_positive_seconds, default=None, metavar="SECONDS",
                 help="start no case that would not end within this many "
                      "seconds of the start, judging by the longest case so "
                      "far (then writing the files takes a few seconds more); "
                      "results so far are written after every case either way")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--list", action="store_true",
                 help="print the cases and exit (no GPU needed)")
  p.add_argument("--replot", "--merge", dest="replot", nargs="+",
                 metavar="RESULTS", default=None,
                 help="re-make the files, table and plots into --out from "
                      "one or more results.json files or --out directories "
                      "(the shards of a run, a re-run of some cases: a later "
                      "one's rows replace an earlier one's), no GPU needed")
  return p


def _shape_cases(args: argparse.Namespace) -> list[Case]:
  """--shape's case, one per dtype; ValueError for a bad shape or mask."""
  s = args.shape
  try:
    return [Case("single", s["B"], s["Tq"], s["Tk"], s["N"], s["K"],
                 s["D"], dtype, causal=args.causal, window=args.window,
                 num_docs=args.docs, seq_lengths=args.lengths)
            for dtype in (args.dtypes or ("bfloat16",))]
  except ValueError as e:
    if "seq_lengths" in str(e):  # Name the flag the user typed.
      raise ValueError(f"--lengths: {e}") from None
    raise


def _suite_flags(args: argparse.Namespace) -> list[str]:
  """The flags given that pick or filter a suite's cases."""
  given = [("--suite", args.suite is not None), ("--quick", args.quick),
           ("--seqlens", args.seqlens is not None),
           ("--head-dims", args.head_dims is not None)]
  return [flag for flag, is_given in given if is_given]


def select_cases(args: argparse.Namespace) -> list[Case]:
  """The cases the arguments ask for. Raises ValueError for bad shapes."""
  if args.shape is not None:
    # Silently running the one shape instead would mislead; --dtypes and
    # --shard still apply (one case per dtype, dealt out like a suite's).
    flags = " and ".join(_suite_flags(args))
    if flags:
      hint = (f"; for --quick's few runs: --iterations {QUICK_ITERATIONS} --no-tune"
              if args.quick else "")
      raise ValueError(f"--shape runs its one shape, not a suite's cases; drop "
                       f"{flags} (or --shape){hint}")
    cases = _shape_cases(args)
    return cases if args.shard is None else cases_lib.shard(cases, *args.shard)
  if (args.causal or args.window is not None or args.docs is not None
      or args.lengths is not None):
    raise ValueError("--causal, --window, --docs and --lengths go with "
                     "--shape")
  if args.quick and args.suite is not None:
    raise ValueError(f"--quick runs its own cases; drop --suite {args.suite} "
                     "(or --quick)")
  suite = "quick" if args.quick else (args.suite or "fa3")
  cases = cases_lib.suite_cases(suite, args.dtypes)
  if args.seqlens is not None:
    cases = [c for c in cases if c.q_len in args.seqlens]
  if args.head_dims is not None:
    cases = [c for c in cases if c.head_dim in args.head_dims]
  if not cases:
    raise ValueError("--seqlens/--head-dims leave no case of the suite")
  if args.shard is not None:
    cases = cases_lib.shard(cases, *args.shard)
  return cases


# Options whose value is a comma-separated list of ints.
INT_LIST_OPTIONS = ("--window", "--lengths", "--seqlens", "--head-dims")


def _join_negative_lists(argv: list[str]) -> list[str]:
  """["--window", "-1,0"] -> ["--window=-1,0"].

  argparse takes a value that starts with '-' for an option unless it is a
  plain number, and says only "expected one argument"; joined, the value
  reaches its own check, which says what is wrong with it.
  """
  joined = []
  for arg in argv:
    if (joined and joined[-1] in INT_LIST_OPTIONS
        and re.fullmatch(r"-\d[-\d, ]*", arg)):
      joined[-1] += "=" + arg
    else:
      joined.append(arg)
  return joined


def parse(argv: list[str] | None) -> argparse.Namespace:
  argv = sys.argv[1:] if argv is None else argv
  args = build_parser().parse_args(_join_negative_lists(argv))
  if args.iterations is None:
    args.iterations = QUICK_ITERATIONS if args.quick else 10
  if args.iterations < 1 or args.warmup < 0:
    build_parser().error("--iterations must be >= 1 and --warmup >= 0")
  if args.interleave is None:
    args.interleave = args.iterations if args.compile_jobs >= 2 else 0
  if (args.interleave < 0 or args.interleave > args.iterations
      or (args.interleave and args.compile_jobs < 2)):
    build_parser().error(
        f"--interleave {args.interleave}: must be 0, or in [1, --iterations "
        f"{args.iterations}] with --compile-jobs >= 2 (got {args.compile_jobs})")
  if args.quick:
    args.no_tune = True
  return args


def hopper_problem() -> str | None:
  """None on a Hopper GPU, else why not (never raises)."""
  try:
    from flash3._device import why_not_hopper
    return why_not_hopper()
  except Exception as e:  # A broken CUDA plugin must not print a traceback.
    return f"no usable accelerator ({type(e).__name__}: {e})"


def _progress(disabled: bool):
  if disabled:
    return None
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return None
  return lambda items: tqdm(items, desc="flash3-bench", unit="case")


def check_out(path: str) -> None:
  """Refuses an --out that cannot become a directory, creating nothing (a run
  without a GPU or with nothing to do leaves no directory behind).

  Raises:
    ValueError: if path, or the nearest of its parents that exists, is not a
      directory.
  """
  full = existing = os.path.abspath(path)
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    where = "is a file" if existing == full else f"is under {existing}, a file"
    raise ValueError(f"--out {path} {where}; allowed: a directory, or a path "
                     "where one can be created")


def make_out(path: str) -> None:
  """Creates the --out directory; ValueError naming it where that fails."""
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise ValueError(f"--out {path}: cannot create the directory "
                     f"({e.strerror or e}); allowed: a directory, or a path "
                     "where one can be created") from None
  if not os.access(path, os.W_OK):
    raise ValueError(f"--out {path}: the directory is not writable")


def _emit(results, env, out_dir, plots: bool) -> None:
  """Writes the files and plots into out_dir, which exists (make_out)."""
  from flash3.bench import report
  results = sorted(results, key=report.sort_key)
  text = report.table(results)
  print(text)
  with open(os.path.join(out_dir, "table.txt"), "w") as f:
    f.write(text + "\n")
  report.write_csv(os.path.join(out_dir, "results.csv"), results, env)
  report.write_json(os.path.join(out_dir, "results.json"), results, env)
  head = report.headline(results)
  if head:
    print("\n" + head)
  with open(os.path.join(out_dir, "summary.md"), "w") as f:
    f.write(report.markdown(results) + "\n" + (f"\n{head}\n" if head else ""))
  written = ["results.json", "results.csv", "table.txt", "summary.md"]
  if plots:
    from flash3.bench import plots as plots_lib
    paths = plots_lib.plot(results, os.path.join(out_dir, "plots"), env)
    written += [os.path.relpath(p, out_dir) for p in paths]
  print(f"\nwrote {', '.join(written)} in {out_dir}")


def read_results(paths: list[str], option: str) -> tuple[list[dict], list]:
  """The environments and row lists of results.json files or directories.

  Raises:
    ValueError: naming ``option`` and the path that cannot be read.
  """
  from flash3.bench import report
  envs, row_lists = [], []
  for path in paths:
    try:
      env, rows = report.read_json(report.results_path(path))
    except (KeyError, TypeError) as e:
      what = f"no {e} field" if isinstance(e, KeyError) else e
      raise ValueError(f"cannot read {option} {path}: not a flash3-bench "
                       f"results.json ({what})") from None
    except (OSError, ValueError) as e:
      raise ValueError(f"cannot read {option} {path}: {e}") from None
    envs.append(env)
    row_lists.append(rows)
  return envs, row_lists


def skip_done(cases: list[Case], row_lists: list, impl_names: list[str],
              modes: tuple[str, ...]) -> list[Case]:
  """The cases lacking a row (any status) for some contender and mode."""
  from flash3.bench.results import case_key_of
  have = {(r.case_key(), r.impl, r.mode) for rows in row_lists for r in rows}
  return [c for c in cases
          if any((case_key_of(c), impl, mode) not in have
                 for impl in impl_names for mode in modes)]


def main(argv: list[str] | None = None) -> int:
  try:
    code = _main(argv)
    sys.stdout.flush()  # Inside the try: a closed pipe surfaces here, not at exit.
    return code
  except BrokenPipeError:
    # The reader went away (e.g. `flash3-bench --list | head`): no traceback.
    # Point stdout at devnull so the interpreter's final flush does not fail too.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _main(argv: list[str] | None) -> int:
  import time
  start = time.monotonic()
  args = parse(argv)
  from flash3.bench import implementations
  try:  # Bad cases, contenders or results files: one line, exit 2.
    selected = select_cases(args)
    impls = implementations.select(
        list(args.impls) if args.impls is not None else None)
    names = [i.name for i in impls]
    if args.replot:
      envs, row_lists = read_results(args.replot, "--replot/--merge")
    elif args.skip_done:
      _, row_lists = read_results(args.skip_done, "--skip-done")
    if not args.list:
      check_out(args.out)
    if args.replot:
      make_out(args.out)
  except ValueError as e:
    print(f"flash3-bench: {e}", file=sys.stderr)
    return 2
  if args.replot:
    from flash3.bench import report, results as results_lib
    results = results_lib.merge(row_lists, implementations.BASELINE)
    _emit(results, report.merge_environments(envs), args.out,
          not args.no_plots)
    return 0
  if args.skip_done:
    before = len(selected)
    selected = skip_done(selected, row_lists, names, tuple(args.modes))
    print(f"flash3-bench: --skip-done: {before - len(selected)} of {before} "
          f"cases already done", file=sys.stderr)
  if args.list:
    for case in selected:
      print(f"{case.suite:6s} {case.label()}")
      if "flash3" in names:
        print(f"       flash3: {implementations.flash3_configs(case)}")
      if "flash3-nondet" in names:
        print(f"       flash3-nondet: "
              f"{implementations.flash3_configs(case, deterministic=False)}")
    shard = ("" if args.shard is None
             else f" (shard {args.shard[0]}/{args.shard[1]})")
    print(f"{len(selected)} cases x {len(args.modes)} modes{shard}")
    return 0
  if not selected:
    why = ("--skip-done found every case done" if args.skip_done
           else f"shard {args.shard[0]}/{args.shard[1]} has no case")
    print(f"flash3-bench: nothing to run: {why}", file=sys.stderr)
    return 0
  problem = hopper_problem()
  if problem is not None:
    print(f"flash3-bench: cannot run: {problem}; it needs an H100 or H200",
          file=sys.stderr)
    return 1
  try:  # Before any case runs: check_out cannot catch every unmakeable path.
    make_out(args.out)
  except ValueError as e:
    print(f"flash3-bench: {e}", file=sys.stderr)
    return 2
  from flash3.bench import report, runner
  env = report.environment(argv)
  options = runner.Options(iterations=args.iterations, warmup=args.warmup,
                           tune=not args.no_tune, modes=tuple(args.modes),
                           compile_jobs=args.compile_jobs,
                           interleave=args.interleave)
  partial = os.path.join(args.out, "results.json")
  progress = _progress(args.no_progress)

  def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)

  results = runner.run(
      selected, impls, options, progress=progress,
      checkpoint=lambda rows: report.write_json(partial, rows, env),
      time_budget_s=args.time_budget, start=start,
      log=log if progress is None else None)
  _emit(results, env, args.out, not args.no_plots)
  return 0
