"""python -m examples.train_gpt: see train.py."""

from .train import main

main()
