#!/usr/bin/env python
"""Train a GPTNeoX model from a recipe: `accelerate launch run_clm_neox.py recipes/tiny.yaml [--train.lr 3e-4]`."""

import sys

from neox_hf.cli import train_main as main

if __name__ == "__main__":
    sys.exit(main())
