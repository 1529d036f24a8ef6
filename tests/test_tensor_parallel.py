"""Tensor parallelism: TP2 (and TP2 x DP2) must reproduce one stock GPTNeoXForCausalLM.

Multi-rank checks run as torchrun + gloo workers (tests/workers/tp_*.py) that save their
results; this process computes the stock single-process reference and compares (fp32,
max abs difference <= 1e-5).
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import GPTNeoXForCausalLM

from neox_hf.errors import CheckpointError, NeoXHFError
from neox_hf.model.vocab import padded_vocab_size
from neox_hf.parallel.tensor_parallel import (apply_tensor_parallel, check_tp_divisibility, load_tp_shard_state_dict,
                                              pad_vocab)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = os.path.join(REPO, "tests", "workers")
sys.path.insert(0, WORKERS)
from tp_common import LR, STEPS, batch, tiny_config, tp_causal_lm_loss  # noqa: E402

from tests.conftest import free_port, launch_env  # noqa: E402

TOL = 1e-5


def _env():
    return launch_env(PYTHONPATH=os.pathsep.join([REPO, WORKERS]))


def run_torchrun(nproc, worker, *args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           os.path.join(WORKERS, worker), *map(str, args)]
    done = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def rank_results(out_dir, name, nproc):
    return [torch.load(os.path.join(out_dir, f"{name}.rank{r}.pt"), weights_only=False) for r in range(nproc)]


def saved_tiny_model(folder, seed=0, **config):
    torch.manual_seed(seed)
    GPTNeoXForCausalLM(tiny_config(**config)).save_pretrained(folder)
    return folder


def stock(folder):
    return GPTNeoXForCausalLM.from_pretrained(folder)


def reference_step(model, input_ids, labels):
    """(logits, loss, grads) of one stock forward/backward."""
    model.zero_grad()
    out = model(input_ids, labels=labels)
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def reference_adamw_losses(model, input_ids, labels, clip_norm=None):
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids, labels=labels).loss
        loss.backward()
        if clip_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def max_diff(a, b):
    return (a - b).abs().max().item()


def assert_grads_close(tp_grads, ref_grads):
    assert sorted(tp_grads) == sorted(ref_grads)
    worst = max(ref_grads, key=lambda n: max_diff(tp_grads[n], ref_grads[n]))
    assert max_diff(tp_grads[worst], ref_grads[worst]) <= TOL, worst


@pytest.fixture(scope="module")
def tp2_launch(tmp_path_factory):
    """One 2-rank launch, on first use, for the TP2 and the sequence-parallel checks: each process costs seconds of
    imports. tp_tp2.py runs its checks, then tp_sp.py's in the same ranks, each set into its own output folder."""
    models = tmp_path_factory.mktemp("models")
    saved_tiny_model(models / "untied")
    saved_tiny_model(models / "tied", seed=1, tie_word_embeddings=True)
    saved_tiny_model(models / "vocab251", seed=2, vocab_size=251)
    saved_tiny_model(models / "sequential", seed=2, use_parallel_residual=False)
    out, sp_out = tmp_path_factory.mktemp("tp2_out"), tmp_path_factory.mktemp("tp2_sp_out")
    run_torchrun(2, "tp_tp2.py", models, out, sp_out)
    return models, out, sp_out


@pytest.fixture(scope="module")
def tp2(tp2_launch):
    models, out, _ = tp2_launch
    return models, out


def test_tp2_forward_and_gradients_match_tp1(tp2):
    models, out = tp2
    model = stock(models / "untied")
    ref_generated = model.generate(batch()[0][:1, :8], max_new_tokens=5, do_sample=False)
    ref_logits, ref_loss, ref_grads = reference_step(model, *batch())
    for rank in rank_results(out, "untied", 2):
        assert torch.equal(rank["generated"], ref_generated)  # stock generate() on the TP model
        assert max_diff(rank["logits"], ref_logits) <= TOL
        assert abs(rank["loss"] - ref_loss) <= TOL
        assert abs(rank["hf_forward_loss"] - ref_loss) <= TOL  # stock forward on gathered logits
        assert_grads_close(rank["grads"], ref_grads)


def test_tp2_adamw_losses_and_saved_merge_match_tp1(tp2):
    models, out = tp2
    model = stock(models / "untied")
    input_ids, labels = batch()
    ref_losses = reference_adamw_losses(model, input_ids, labels)
    for rank in rank_results(out, "untied", 2):
        assert max(abs(a - b) for a, b in zip(rank["losses"], ref_losses)) <= TOL
        assert rank["merged_shapes"] == {k: tuple(v.shape) for k, v in model.state_dict().items()}

    merged = stock(out / "merged")  # TP2 gather -> save_pretrained -> stock from_pretrained
    with torch.no_grad():
        merged_logits, tp1_logits = merged(input_ids).logits, model(input_ids).logits
    # Gather + save + stock load adds no error of its own.
    assert max_diff(merged_logits, rank["trained_logits"]) <= 1e-6
    # Against TP1 trained alongside: 5 Adam steps divide each gradient by its own running RMS, so ~1e-7 reduction-order
    # differences in near-zero gradients move weights by up to lr; the logits stay within a few 1e-5 (CPU-dependent).
    assert max_diff(merged_logits, tp1_logits) <= 1e-4


def test_tp2_reads_only_its_slices_from_a_stock_checkpoint(tp2):
    _, out = tp2
    for rank in rank_results(out, "untied", 2):
        assert rank["shard_keys_match"]
        assert rank["shard_max_diff"] == 0.0


def test_tied_embeddings_share_one_shard_and_match_tp1(tp2):
    models, out = tp2
    ref_logits, ref_loss, ref_grads = reference_step(stock(models / "tied"), *batch())
    for rank in rank_results(out, "tied", 2):
        assert rank["still_tied"]
        assert max_diff(rank["logits"], ref_logits) <= TOL
        assert abs(rank["loss"] - ref_loss) <= TOL
        assert_grads_close(rank["grads"], ref_grads)


def test_padded_vocab_keeps_real_token_logits_and_loss(tp2):
    models, out = tp2
    ref_logits, ref_loss, ref_grads = reference_step(stock(models / "vocab251"), *batch(vocab=251))
    for rank in rank_results(out, "padding", 2):
        assert "pad_vocab(model, padded_vocab_size(251" in rank["refusal"]
        assert rank["sliced_padded_load_equal"]
        assert rank["logits"].shape[-1] == 256
        assert max_diff(rank["logits"][..., :251], ref_logits) <= TOL
        assert abs(rank["loss"] - ref_loss) <= TOL  # real_vocab_size masks the 5 fake tokens
        padded = {n: g[:251] if n in ("gpt_neox.embed_in.weight", "lm_head.weight") else g
                  for n, g in rank["grads"].items()}
        assert_grads_close(padded, ref_grads)


def test_vocab_parallel_cross_entropy_equals_cross_entropy_on_gathered_logits(tp2):
    _, out = tp2
    for rank in rank_results(out, "cross_entropy", 2):
        for real_vocab in (None, 200):
            logits = rank["full_logits"][..., :real_vocab].clone().requires_grad_()
            labels = rank[f"labels_{real_vocab}"]
            expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            expected.backward()
            assert abs(rank[f"loss_{real_vocab}"] - expected.detach()) <= TOL
            grad = rank[f"grad_{real_vocab}"]
            assert max_diff(grad[..., :real_vocab], logits.grad) <= TOL
            assert torch.all(grad[..., logits.shape[-1]:] == 0)  # padded columns get no gradient


@pytest.fixture(scope="module")
def tp2_sp(tp2_launch):
    models, _, sp_out = tp2_launch
    return models, sp_out


@pytest.mark.parametrize("name", ["untied", "tied", "sequential"])
def test_sequence_parallel_tp2_matches_tp1_forward_gradients_and_steps(tp2_sp, name):
    models, out = tp2_sp
    input_ids, labels = batch()
    ref_logits, ref_loss, ref_grads = reference_step(stock(models / name), input_ids, labels)
    ref_losses = reference_adamw_losses(stock(models / name), input_ids, labels)
    for rank in rank_results(out, name, 2):
        assert max_diff(rank["logits"], ref_logits) <= TOL
        assert abs(rank["loss"] - ref_loss) <= TOL
        assert_grads_close(rank["grads"], ref_grads)  # norms and row biases: partial sums all-reduced
        assert abs(rank["loop_loss"] - ref_loss) <= TOL
        assert_grads_close(rank["loop_grads"], ref_grads)  # the head's re-gathered input slice
        assert max(abs(a - b) for a, b in zip(rank["losses"], ref_losses)) <= TOL


def test_sequence_parallel_loads_sliced_and_keeps_less_for_backward(tp2_sp):
    models, out = tp2_sp
    with torch.no_grad():
        ref_logits = stock(models / "untied")(batch()[0]).logits
    for rank in rank_results(out, "loaded", 2):
        assert max_diff(rank["logits"], ref_logits) <= TOL
    config = tiny_config()
    # Without SP each layer keeps three replicated [batch, seq, hidden] fp32 tensors for backward (the layer input both
    # norms read in a parallel-residual layer, and the two norm outputs the column layers read), plus the final norm's
    # input; SP keeps half of each. The rest (per-head attention, MLP 4h, logits) is split by TP already.
    replicated = (3 * config.num_hidden_layers + 1) * 2 * 64 * config.hidden_size * 4
    for rank in rank_results(out, "memory", 2):
        tp, sp = rank["saved_bytes_sp_False"], rank["saved_bytes_sp_True"]
        print(f"\nsaved for backward per rank: TP2 {tp} B, TP2+SP {sp} B ({sp / tp:.2f}x)")
        assert tp - sp >= replicated / 2
    for rank in rank_results(out, "refusal", 2):
        assert "sequence length must be divisible by the tensor-parallel size" in rank["refusal"]


def memory_reports(jobs, out, tp_size=4):
    """tp_memory.py's result for each (model_dir, mode) of `jobs`: one process, a forked fresh child per measurement."""
    cmd = [sys.executable, os.path.join(WORKERS, "tp_memory.py"), str(tp_size), str(out)]
    cmd += [str(x) for job in jobs for x in job]
    done = subprocess.run(cmd, env=_env(), timeout=180, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return dict(zip(jobs, json.loads(out.read_text())))


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    """Both memory tests' checkpoints, measured by one tp_memory.py process (imports paid once) on first use."""
    root = tmp_path_factory.mktemp("tp_memory")
    for name, vocab_size in (("model", 8192), ("padded_model", 8190)):
        config = tiny_config(hidden_size=512, num_attention_heads=8, num_hidden_layers=4,
                             intermediate_size=2048, vocab_size=vocab_size)
        GPTNeoXForCausalLM(config).save_pretrained(root / name, max_shard_size="30MB")
    jobs = [(root / "model", "shard"), (root / "model", "full"), (root / "padded_model", "padded"),
            (root / "padded_model", "full")]
    return root, memory_reports(jobs, root / "memory.json")


@pytest.mark.distributed  # slow tier: a whole run in a subprocess or in process
def test_loading_one_rank_slice_needs_a_fraction_of_the_memory(memory):
    root, reports = memory  # the model: tiny_config(hidden 512, 8 heads, 4 layers, 4h 2048, vocab 8192), 30MB shards
    assert (root / "model" / "model.safetensors.index.json").exists()
    shard, full = reports[root / "model", "shard"], reports[root / "model", "full"]
    print(f"\nTP4 rank-0 slice: {shard}\nfull checkpoint: {full}")
    assert shard["slices_match"]
    assert full["loaded_weights_mb"] > 60 and full["peak_rss_growth_mb"] > 0.9 * full["loaded_weights_mb"]
    # Not 1/4: a column slice of a row-parallel weight touches every page of the tensor.
    assert shard["peak_rss_growth_mb"] < 0.65 * full["peak_rss_growth_mb"]


@pytest.mark.distributed  # slow tier: a whole run in a subprocess or in process
def test_loading_a_padded_vocabulary_slice_needs_a_fraction_of_the_memory(memory):
    """A vocabulary TP does not divide (8190 → 8192 rows for TP4) is padded slice by slice, never read whole: the
    last rank, which holds the padding rows, copies only its two vocabulary slices."""
    root, reports = memory  # the model: as above with vocab 8190
    padded, full = reports[root / "padded_model", "padded"], reports[root / "padded_model", "full"]
    print(f"\nTP4 rank-3 padded slice: {padded}\nfull checkpoint: {full}")
    assert padded["slices_match"]  # equal to pad_vocab of the whole matrices, then split
    vocab_slices_mb = 2 * (8192 // 4) * 512 * 4 / 2**20  # embed_in and embed_out rows of this rank, fp32
    assert padded["anon_rss_growth_mb"] <= 1.1 * vocab_slices_mb  # the only private copies
    assert padded["peak_rss_growth_mb"] < 0.7 * full["peak_rss_growth_mb"]


def test_tp1_without_distributed_matches_stock_loss(tmp_path):
    folder = saved_tiny_model(tmp_path / "model")
    input_ids, labels = batch()
    ref = stock(folder)(input_ids, labels=labels).loss
    model = apply_tensor_parallel(stock(folder), tp_group=None)
    assert abs(tp_causal_lm_loss(model, input_ids, labels) - ref) <= TOL


def test_pad_vocab_keeps_real_token_logits(tmp_path):
    folder = saved_tiny_model(tmp_path / "model", vocab_size=251)
    input_ids, _ = batch(vocab=251)
    with torch.no_grad():
        ref = stock(folder)(input_ids).logits
        for init in ("zeros", "mean"):
            padded = pad_vocab(stock(folder), padded_vocab_size(251, 128, 2), init=init)
            assert padded.config.vocab_size == 256
            assert max_diff(padded(input_ids).logits[..., :251], ref) == 0.0

    state = stock(folder).state_dict()
    padded_state = pad_vocab(state, 256)
    assert padded_state["lm_head.weight"].shape[0] == 256 and state["lm_head.weight"].shape[0] == 251
    assert padded_state["gpt_neox.embed_in.weight"][251:].abs().max() == 0.0


def test_padded_vocab_size_follows_gpt_neox_rule():
    assert padded_vocab_size(50277, 128, 1) == 50304
    assert padded_vocab_size(50277, 128, 2) == 50432
    assert padded_vocab_size(256, 128, 2) == 256


def test_refuses_shapes_that_do_not_split():
    model = GPTNeoXForCausalLM(tiny_config())
    with pytest.raises(NeoXHFError, match="num_attention_heads=4 is not divisible by tensor parallel size 3"):
        check_tp_divisibility(model, 3)
    with pytest.raises(NeoXHFError, match=r"pad_vocab\(model, padded_vocab_size\(251"):
        check_tp_divisibility(GPTNeoXForCausalLM(tiny_config(vocab_size=251)), 2)
    with pytest.raises(NeoXHFError, match="GPTNeoXForCausalLM"):
        apply_tensor_parallel(torch.nn.Linear(2, 2), None)
    with pytest.raises(NeoXHFError, match="shrink"):
        pad_vocab(model, 100)


def test_refuses_a_folder_without_safetensors(tmp_path):
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_tp_shard_state_dict(str(tmp_path), tiny_config(), 0, 2)


def test_tp_plan_is_transformers_own_plan_in_our_layer_kinds():
    from neox_hf.parallel.tp_plan import TP_PLAN, partition_dim, transformers_tp_plan

    assert transformers_tp_plan() == TP_PLAN
    # Every sharded module's weight is split along the dim its kind implies, and every tensor of a stock model is
    # covered by the one table (rotary buffers aside).
    model = GPTNeoXForCausalLM(tiny_config())
    dims = {k: partition_dim(k) for k in model.state_dict() if "rotary" not in k}
    assert dims["gpt_neox.layers.0.attention.query_key_value.weight"] == 0
    assert dims["gpt_neox.layers.1.mlp.dense_4h_to_h.weight"] == 1
    assert dims["gpt_neox.layers.1.mlp.dense_4h_to_h.bias"] is None
    assert dims["lm_head.weight"] == dims["gpt_neox.embed_in.weight"] == 0
    from neox_hf.parallel.tp_plan import split_rule

    assert all(split_rule(k) is not None for k in dims)
