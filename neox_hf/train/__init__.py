"""Training: the loop and its hooks (log, eval, checkpoint, push), the LR schedule, guards, prefetching, MFU.
The entry point `run_clm_neox.py` calls is `neox_hf.cli.train_main`."""
