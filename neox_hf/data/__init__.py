"""Data layer: streamed corpora → per-rank batches for GPT-NeoX-class training. Knows a tokenizer, no model.

    sources.py   local files / Hub / .bin-.idx → token rows; blending, per-rank split, validation hold-out
    indexed.py   GPT-NeoX mmap `.bin/.idx` reader and writer
    padding.py   dynamic padding, length bucketing, token budgets
    packing.py   GPT-NeoX windows, document-isolated packing, the epoch arithmetic
    loader.py    buffers → batches, infinite epochs, exact resume; the train loop's entry points
    neox_order.py  GPT-NeoX's exact sample order (split, index mappings and their caches, blending, per-rank slices)
    curriculum.py  sequence-length curriculum (DeepSpeed's scheduler) applied to batches
    files.py     plain / .gz / .zst file opening shared by sources and the .bin/.idx writer
"""

from neox_hf.data.indexed import IndexedDataset, write_indexed_dataset
from neox_hf.data.loader import (DataLoader, DataNotes, build_eval_loader, build_neox_valid_loader,
                                 build_train_loader, tokens_per_epoch)
from neox_hf.data.packing import gpt_neox_num_epochs
from neox_hf.data.sources import document_stream

__all__ = ["DataLoader", "DataNotes", "IndexedDataset", "build_eval_loader", "build_neox_valid_loader",
           "build_train_loader", "document_stream", "gpt_neox_num_epochs", "tokens_per_epoch", "write_indexed_dataset"]
