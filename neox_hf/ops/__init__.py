"""Compute kernels written in plain PyTorch (CPU and GPU) that the libraries we build on lack."""

from neox_hf.ops.linear_cross_entropy import default_chunk_rows, head_loss, lm_head_loss, linear_cross_entropy

__all__ = ["default_chunk_rows", "head_loss", "linear_cross_entropy", "lm_head_loss"]
