"""Context parallelism (`parallel.context_parallel: N`): every sequence in N contiguous chunks over N ranks, attention
exchanging sequence for heads by all-to-all — DeepSpeed's Ulysses (`UlyssesSPAttentionHF`), injected through
transformers' attention registry into the unmodified model.

Each rank embeds, normalises, runs the MLPs and the head loss (the fused linear-CE, no full logits) on its chunk only;
inside attention an all-to-all turns [chunk, all heads] into [whole sequence, heads / N], SDPA runs on the whole
sequence, and a second all-to-all turns it back. Everything a position carries goes with it into its chunk:

- labels are aligned with the inputs before the split (the loaders shift: position t's label is token t + 1), so the
  label of a chunk's last token — the first token of the next chunk — is already in place;
- position ids are the sequence's own (0..T-1, or restarting per packed document), so rotary embeddings rotate
  every chunk as one process does, whatever `rotary_pct`;
- packed documents (`data.isolate_documents`) get the block-diagonal causal mask of the whole sequence, built
  from the gathered position ids inside attention (`neox_hf.ops.loss.document_causal_mask`), so attention never
  crosses a document even where a document spans two chunks.

The loss of a chunk is a sum and a count like any micro-batch's (`neox_hf.ops.loss`): the engines sum both over the
data- and context-parallel ranks (`neox_hf.parallel.layout.shard_sum`), never multiplying or dividing by N.

accelerate 1.16's `ParallelismConfig(sp_backend="deepspeed")` is not used: it builds DeepSpeed's own process groups
(`parallel_state_sp`, the sequence-parallel ranks consecutive, beside no tensor parallelism), while ours come from the
run's layout; its DeepSpeed mpu would also replace ours (`neox_hf.parallel.tp_groups`). Its batch adapter
(`UlyssesSPDataLoaderAdapter`) is not used either: it shards its own loader's batches, while ours are sharded per
micro-batch inside the step (`sequence_chunk`), after the step has counted them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from neox_hf.data.padding import IGNORE_INDEX
from neox_hf.errors import NeoXHFError
from neox_hf.ops.loss import SEQUENCE_CHUNK, document_causal_mask

ULYSSES = "neox_hf_ulysses_sdpa"
# How a sequence is dealt over the context-parallel ranks: one contiguous chunk each (Ulysses: the all-to-all
# regathers the whole sequence, so the order is free), or torch's head-tail load balancing (ring attention on the
# FSDP2 engine, `neox_hf.ops.ring_attention`: 2N chunks, rank r holding r and 2N - 1 - r, so that every rank's
# share of the causal triangle is equal).
CONTIGUOUS, HEAD_TAIL = "contiguous", "head_tail"


@dataclass(frozen=True)
class SequenceChunk:
    """What `decoder_hidden_states` needs to run a chunk: the attention to run it with, and whether the sequence
    holds packed documents kept apart (its batch had `position_ids`); and what an objective that reduces whole
    sequences (DPO, KTO, RM: `sequence_total`, `last_token_value`) needs: the context-parallel group, this chunk's
    rank in it and the sequences' length before any padding to equal chunks."""

    attention: str
    isolate_documents: bool
    rank: int = 0
    length: int = 0
    group: object = field(default=None, compare=False)  # None: the default group (a test's process of its own)
    ranks: int = 1
    order: str = CONTIGUOUS

    def columns(self, width: int, device=None) -> torch.Tensor:
        """[width] the columns of the (padded) whole sequence this chunk of `width` tokens holds, in its order."""
        return chunk_columns(width * self.ranks, self.ranks, self.rank, self.order, device=device)


def chunk_bounds(length: int, ranks: int, rank: int) -> tuple[int, int]:
    """[start, end) of rank `rank`'s contiguous chunk of a sequence of `length` tokens (a multiple of `ranks`)."""
    if length % ranks:
        raise NeoXHFError(f"a sequence of {length} tokens does not split into {ranks} equal chunks")
    size = length // ranks
    return rank * size, (rank + 1) * size


def chunk_columns(length: int, ranks: int, rank: int, order: str = CONTIGUOUS, *, device=None) -> torch.Tensor:
    """The columns of a sequence of `length` tokens that rank `rank` of `ranks` holds, in the order it holds them:
    its contiguous chunk, or under HEAD_TAIL the chunks `rank` and 2·ranks − 1 − `rank` of 2·ranks equal ones
    (torch's `_HeadTailLoadBalancer`, which its ring attention's causal block skipping assumes)."""
    if order == CONTIGUOUS:
        start, end = chunk_bounds(length, ranks, rank)
        return torch.arange(start, end, device=device)
    head, tail = chunk_bounds(length, 2 * ranks, rank), chunk_bounds(length, 2 * ranks, 2 * ranks - 1 - rank)
    return torch.cat([torch.arange(*head, device=device), torch.arange(*tail, device=device)])


def sequence_chunk(batch: dict, *, ranks: int, rank: int, attention: str = ULYSSES, group=None,
                   order: str = CONTIGUOUS) -> dict:
    """This rank's chunk of every sequence of `batch` (`input_ids`, `labels`, `attention_mask`; contiguous, or its
    head and tail chunks under HEAD_TAIL), with the whole sequence's position ids at those columns (0..T-1 when the
    batch has none) and the `SequenceChunk` the decoder reads; the batch's other entries (per row or per batch:
    `ref_logps`, `pair_index`, KTO's `label`) as they are.

    A length that does not split into equal chunks (pad mode) is padded first at the right end: pad tokens carry
    label -100 and come after every real token, so under causal attention they change nothing a label reads."""
    ids = batch["input_ids"]
    rows, length = ids.shape
    documents = batch.get("position_ids") is not None
    positions = (batch["position_ids"] if documents else torch.arange(length, device=ids.device)).expand(rows, length)
    padded = {"input_ids": ids, "labels": batch.get("labels"), "attention_mask": batch.get("attention_mask"),
              "position_ids": positions}
    extra = (-length) % (ranks * (2 if order == HEAD_TAIL else 1))
    if extra:
        fill = {"input_ids": 0, "labels": IGNORE_INDEX, "attention_mask": 0}
        for key, value in list(padded.items()):
            if value is None:
                continue
            if key == "position_ids":
                tail = value[:, -1:] + torch.arange(1, extra + 1, device=value.device)
            else:
                tail = torch.full((rows, extra), fill[key], dtype=value.dtype, device=value.device)
            padded[key] = torch.cat([value, tail], dim=1)
    columns = chunk_columns(length + extra, ranks, rank, order, device=ids.device)
    chunk = {key: value for key, value in batch.items() if key not in padded}
    chunk.update({key: value.index_select(1, columns) for key, value in padded.items() if value is not None})
    chunk[SEQUENCE_CHUNK] = SequenceChunk(attention, documents, rank=rank, length=length, group=group, ranks=ranks,
                                          order=order)
    return chunk


def sequence_total(values: torch.Tensor, batch: dict) -> torch.Tensor:
    """Per-sequence `values` [rows] of this rank's chunk summed over the context-parallel group: the whole sequences'
    (one process: `values` itself). Autograd: the backward all-reduces the gradient too, so a loss that only the
    group's first rank counts (`counts_sequences`) reaches every rank's chunk."""
    chunk = batch.get(SEQUENCE_CHUNK)
    if chunk is None:
        return values
    from torch.distributed.nn.functional import all_reduce

    return all_reduce(values, group=chunk.group)


def counts_sequences(batch: dict) -> bool:
    """Whether this rank counts the batch's whole-sequence losses, units and metrics: every context-parallel rank
    computes them (from `sequence_total`), the group's first one reports them, so the step's sum over the
    context-parallel ranks holds each once."""
    chunk = batch.get(SEQUENCE_CHUNK)
    return chunk is None or chunk.rank == 0


def last_token_value(values: torch.Tensor, batch: dict, pad_token_id) -> torch.Tensor:
    """[rows, ...] `values` [rows, T, ...] at each row's last token that is not `pad_token_id` (transformers'
    sequence-classification pooling: the rightmost non-pad token, column 0 where none is), of the whole sequences
    under context parallelism: the rank whose chunk holds that column gives it, the others zero, summed over the
    group (with autograd, `sequence_total`)."""
    ids = batch["input_ids"]
    rows, width = ids.shape
    chunk = batch.get(SEQUENCE_CHUNK)
    columns = chunk.columns(width, ids.device) if chunk is not None else torch.arange(width, device=ids.device)
    length = chunk.length if chunk is not None else width
    real = (ids != pad_token_id) & (columns < length) if pad_token_id is not None else (columns < length)
    last = (columns * real).amax(dim=-1) if pad_token_id is not None else torch.full((rows,), length - 1,
                                                                                     device=ids.device)
    if chunk is None:
        return values[torch.arange(rows, device=ids.device), last]
    import torch.distributed as dist

    dist.all_reduce(last, op=dist.ReduceOp.MAX, group=chunk.group)
    held = columns.unsqueeze(0) == last.unsqueeze(1)  # [rows, width]: where this chunk holds the row's last token
    picked = values[torch.arange(rows, device=ids.device), held.int().argmax(dim=-1)]
    mask = held.any(dim=-1).view(-1, *([1] * (picked.dim() - 1)))
    return sequence_total(torch.where(mask, picked, torch.zeros_like(picked)), batch)


def _whole_sequence_sdpa(module, query, key, value, attention_mask, *, position_ids=None, isolate_documents=False,
                         **kwargs):
    """transformers' SDPA on the whole sequence (after Ulysses' all-to-all): causal, or within each packed document
    when the batch keeps documents apart (`position_ids` are the gathered ones of the whole sequence)."""
    if isolate_documents:
        attention_mask = document_causal_mask(position_ids)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _ulysses_base():
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    return UlyssesSPAttentionHF


def ulysses_attention(group, *, heads: int, kv_heads: int, head_size: int, layers: int):
    """DeepSpeed's `UlyssesSPAttentionHF` over `group`, for this rank's `heads` query and `kv_heads` key/value heads
    (its tensor-parallel share), with the gaps below filled."""

    class UlyssesAttention(_ulysses_base()):
        """Gaps filled in DeepSpeed's class: it fixes the micro-batch size when built (its shape checks and
        reshapes), while ours varies (token budgets, the last eval batch), so the shapes are set per call; and its
        SDPA path is causal only, so packed documents get their mask on the gathered sequence
        (`_whole_sequence_sdpa`)."""

        def forward(self, module, query, key, value, attention_mask, *args, **kwargs):
            rows = query.shape[0]
            self.batch_size = rows
            self.required_query_shape = torch.Size([1, rows, self.attn_head_count, self.attn_head_size])
            self.required_key_value_shape = torch.Size([1, rows, self.global_kv_head_count, self.attn_head_size])
            self.required_context_shape = torch.Size([1, rows, self.attn_head_size * self.attn_head_count
                                                      // self.world_size])
            return super().forward(module, query, key, value, attention_mask, *args, **kwargs)

    return UlyssesAttention(_whole_sequence_sdpa, batch_size=1, attn_head_count=heads, attn_head_size=head_size,
                            kv_head_count=kv_heads, num_hidden_layers=layers, process_group=group,
                            seq_length_is_variable=True)


def register_context_parallel_attention(config, group, *, tensor_parallel: int = 1) -> str:
    """Register the Ulysses attention over `group` for a model of `config` (this rank's tensor-parallel share of its
    heads) in transformers' attention registry; the name `sequence_chunk` batches run with. Registered again by each
    run (a process that trains several layouts in turn gets the latest run's group)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_size = getattr(text, "head_dim", None) or text.hidden_size // heads
    attention = ulysses_attention(group, heads=heads // tensor_parallel, kv_heads=kv_heads // tensor_parallel,
                                  head_size=head_size, layers=text.num_hidden_layers)
    AttentionInterface.register(ULYSSES, attention)
    return ULYSSES
