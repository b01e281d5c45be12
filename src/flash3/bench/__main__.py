"""``python -m flash3.bench`` and the ``flash3-bench`` console script."""

import sys

from flash3.bench.cli import main as _main


def main() -> int:
  """Entry point: runs the command line and returns its exit status."""
  return _main(sys.argv[1:])


if __name__ == "__main__":
  sys.exit(main())
