"""flash3's benchmark suite: flash3 against cuDNN, XLA, jax's FA3 and tokamax.

Run it with ``flash3-bench`` or ``python -m flash3.bench`` on a Hopper GPU;
docs/benchmarks/README.md explains the options and how numbers are made.

Modules, one concern each:

* ``cases``: the benchmark shapes (``Case``) and the named suites.
* ``flops``: FlashAttention-3's FLOP convention, counting visible pairs.
* ``implementations``: the contenders, each built for one case or refused.
* ``reference``: the float32 reference and the correctness gate.
* ``timing``: CUPTI kernel time, warm-up, median and spread.
* ``runner``: runs every case on every implementation in one process.
* ``report``: the terminal table, CSV and JSON, environment metadata.
* ``plots``: TFLOP/s against sequence length (matplotlib, imported lazily).
* ``cli``: the command line.

Nothing here is imported by ``import flash3``; matplotlib and tqdm (the
``bench`` extra) are imported only when needed.
"""
