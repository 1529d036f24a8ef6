"""torchrun worker: one data-parallel rank builds its own stream and loader from RANK / WORLD_SIZE, checks
its own resume, and writes what it saw to <out>/data.rank<R>.json for tests/test_data_resume.py."""

import io
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from data_common import batch_documents, neox_tokenizer  # noqa: E402

from neox_hf.data import build_train_loader, document_stream  # noqa: E402
from neox_hf.recipe import DataConfig, DataSource  # noqa: E402


def main(out_dir: str, path: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    tok = neox_tokenizer()
    source = DataSource(path=path, template="Question: {question}\nAnswer: {answer}")
    rows = document_stream([source], tok, epoch=0, seed=1234, dp_rank=rank, dp_size=world)
    docs = [r["input_ids"] for r in rows if r["skip"] == ""]

    cfg = DataConfig(sources=[source], mode="pad", buffer_size=32)
    loader = build_train_loader(cfg, tok, seq_length=512, micro_batch_size=4, dp_rank=rank, dp_size=world)
    first = [next(loader) for _ in range(6)]
    saved = io.BytesIO()
    torch.save(loader.state_dict(), saved)
    expected = [next(loader) for _ in range(5)]
    resumed = build_train_loader(cfg, tok, seq_length=512, micro_batch_size=4, dp_rank=rank, dp_size=world)
    saved.seek(0)
    resumed.load_state_dict(torch.load(saved, weights_only=False))
    got = [next(resumed) for _ in range(5)]
    exact = all(torch.equal(a[k], b[k]) for a, b in zip(expected, got) for k in a)
    batch_docs = [list(d) for b in first + expected for d in batch_documents(b, tok.eos_token_id)]
    with open(os.path.join(out_dir, f"data.rank{rank}.json"), "w") as f:
        json.dump({"docs": docs, "batch_docs": batch_docs, "resume_exact": exact}, f)


if __name__ == "__main__":
    main(*sys.argv[1:])
