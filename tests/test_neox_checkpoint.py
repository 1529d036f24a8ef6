"""GPT-NeoX-native checkpoints -> HF and back.

The checkpoints here are written the way GPT-NeoX writes them (both layouts,
TP 1 and 2, random per-rank shards) and the converted HF model must reproduce
the logits of ``neox_reference``, a rank-by-rank GPT-NeoX forward pass.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from neox_hf.errors import CheckpointError
from neox_hf.interop.neox_checkpoint import export_neox_checkpoint, load_neox_state_dict, neox_to_hf_model
from neox_reference import neox_reference_logits

HIDDEN, HEADS, LAYERS, VOCAB, FF = 64, 4, 2, 128, 256


def tiny_config(*, parallel_residual: bool = True, tied: bool = False, **overrides) -> transformers.GPTNeoXConfig:
    values = dict(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
        intermediate_size=FF, max_position_embeddings=64, hidden_act="gelu", layer_norm_eps=1e-5,
        use_parallel_residual=parallel_residual, tie_word_embeddings=tied,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    values.update(overrides)
    return transformers.GPTNeoXConfig(**values)


def random_neox_shards(config, tp: int, seed: int = 0) -> list[dict[int, dict[str, torch.Tensor]]]:
    """Return ``ranks[r][idx][param]`` as GPT-NeoX would hold them, with random values.

    Layer norms are replicated (equal on all ranks). Row-parallel biases differ per rank
    in parallel-residual models, so only the sum rule reproduces the reference; in
    sequential-residual models they are equal, as GPT-NeoX keeps them.
    """
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=gen) * scale

    h, ff, v = HIDDEN // tp, FF // tp, VOCAB // tp
    ranks = [{} for _ in range(tp)]
    for r in range(tp):
        ranks[r][0] = {"word_embeddings.weight": rand(v, HIDDEN)}
    for i in range(LAYERS):
        norms = {f"{ln}.{p}": (1 + rand(HIDDEN) if p == "weight" else rand(HIDDEN))
                 for ln in ("input_layernorm", "post_attention_layernorm") for p in ("weight", "bias")}
        shared_biases = {"attention.dense.bias": rand(HIDDEN), "mlp.linear2.bias": rand(HIDDEN)}
        for r in range(tp):
            biases = ({"attention.dense.bias": rand(HIDDEN), "mlp.linear2.bias": rand(HIDDEN)}
                      if config.use_parallel_residual else shared_biases)
            ranks[r][i + 2] = {
                **{k: t.clone() for k, t in norms.items()},
                "attention.query_key_value.weight": rand(3 * h, HIDDEN),
                "attention.query_key_value.bias": rand(3 * h),
                "attention.dense.weight": rand(HIDDEN, h),
                "mlp.linear1.weight": rand(ff, HIDDEN),
                "mlp.linear1.bias": rand(ff),
                "mlp.linear2.weight": rand(HIDDEN, ff),
                **{k: t.clone() for k, t in biases.items()},
            }
    final_norm = {"norm.weight": 1 + rand(HIDDEN), "norm.bias": rand(HIDDEN)}
    for r in range(tp):
        ranks[r][LAYERS + 3] = {k: t.clone() for k, t in final_norm.items()}
        if not config.tie_word_embeddings:
            ranks[r][LAYERS + 4] = {"final_linear.weight": rand(v, HIDDEN)}
    return ranks


def write_neox_checkpoint(ranks, root: Path, layout: str, *, step: int = 7, rank_extras: dict | None = None) -> Path:
    """Write ``ranks`` as GPT-NeoX does: ``root/global_step{step}/...`` plus ``root/latest``."""
    step_dir = root / f"global_step{step}"
    step_dir.mkdir(parents=True)
    (root / "latest").write_text(f"global_step{step}")
    for r, layers in enumerate(ranks):
        if layout == "pipeline":
            for idx, params in layers.items():
                torch.save(params, step_dir / f"layer_{idx:02d}-model_{r:02d}-model_states.pt")
        else:
            module = {f"sequential.{idx}.{k}": t for idx, params in layers.items() for k, t in params.items()}
            torch.save({"module": module, **(rank_extras or {})}, step_dir / f"mp_rank_{r:02d}_model_states.pt")
    return step_dir


def hf_logits(model, input_ids) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids).logits


INPUT_IDS = torch.tensor([[1, 5, 127, 64, 63, 0, 99, 12], [3, 3, 70, 2, 126, 65, 8, 40]])


@pytest.mark.parametrize("layout", ["pipeline", "sequential"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("parallel_residual", [True, False], ids=["parallel", "sequential_residual"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_converted_model_matches_neox_reference(tmp_path, layout, tp, parallel_residual, tied):
    config = tiny_config(parallel_residual=parallel_residual, tied=tied)
    ranks = random_neox_shards(config, tp)
    write_neox_checkpoint(ranks, tmp_path, layout)

    model = neox_to_hf_model(tmp_path, config)

    expected = neox_reference_logits(ranks, config, INPUT_IDS)
    torch.testing.assert_close(hf_logits(model, INPUT_IDS), expected, atol=1e-5, rtol=0)
    # Tied means one parameter (fine-tuning must keep them equal), not two equal copies.
    assert (model.lm_head.weight is model.gpt_neox.embed_in.weight) == tied


def test_legacy_mlp_names_and_rotary_buffers_load_from_step_dir(tmp_path):
    config = tiny_config(hidden_act="gelu_pytorch_tanh")
    ranks = random_neox_shards(config, tp=2, seed=1)
    renames = {"mlp.linear1": "mlp.dense_h_to_4h", "mlp.linear2": "mlp.dense_4h_to_h"}
    legacy = [
        {idx: {_rename(k, renames): t for k, t in params.items()} for idx, params in rank.items()}
        for rank in ranks
    ]
    for rank in legacy:
        for i in range(LAYERS):
            rank[i + 2]["attention.rotary_emb.inv_freq"] = torch.ones(4)  # save_inv_freqs=True
    step_dir = write_neox_checkpoint(legacy, tmp_path, "pipeline")

    model = neox_to_hf_model(step_dir, config)  # the step folder itself, not its parent

    expected = neox_reference_logits(ranks, config, INPUT_IDS)
    torch.testing.assert_close(hf_logits(model, INPUT_IDS), expected, atol=1e-5, rtol=0)


def _rename(key: str, renames: dict[str, str]) -> str:
    for old, new in renames.items():
        key = key.replace(old, new)
    return key


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("parallel_residual", [True, False], ids=["parallel", "sequential_residual"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_export_then_import_is_bit_exact_and_neox_computes_the_same(tmp_path, tp, parallel_residual, tied):
    config = tiny_config(parallel_residual=parallel_residual, tied=tied)
    torch.manual_seed(0)
    model = transformers.GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():  # random biases too, so a lost or doubled bias shows
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
        # +0.0 and -0.0 must survive too (rank 1's share of a summed bias is -0.0).
        model.gpt_neox.layers[0].attention.dense.bias[:2] = torch.tensor([0.0, -0.0])
    original = {k: t.clone() for k, t in model.state_dict().items()}

    step_dir = Path(export_neox_checkpoint(model, config, tmp_path / "out", tp_size=tp, step=3))

    assert step_dir.name == "global_step3"
    assert (tmp_path / "out" / "latest").read_text() == "global_step3"
    assert sorted(os.listdir(step_dir)) == [f"mp_rank_{r:02d}_model_states.pt" for r in range(tp)]
    reloaded = load_neox_state_dict(tmp_path / "out", config)
    assert reloaded.keys() == original.keys()
    for key, tensor in original.items():
        assert torch.equal(_bits(reloaded[key]), _bits(tensor)), key
    # The exported shards, run the GPT-NeoX way, give the HF model's logits.
    ranks = _read_sequential_ranks(step_dir, tp)
    torch.testing.assert_close(neox_reference_logits(ranks, config, INPUT_IDS), hf_logits(model, INPUT_IDS),
                               atol=1e-5, rtol=0)


def _read_sequential_ranks(step_dir: Path, tp: int):
    ranks = []
    for r in range(tp):
        module = torch.load(step_dir / f"mp_rank_{r:02d}_model_states.pt", weights_only=True)["module"]
        layers: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in module.items():
            _, idx, name = key.split(".", 2)
            layers.setdefault(int(idx), {})[name] = t
        ranks.append(layers)
    return ranks


def test_export_refuses_to_overwrite_and_leaves_no_temp_files(tmp_path):
    config = tiny_config()
    model = transformers.GPTNeoXForCausalLM(config)
    export_neox_checkpoint(model, config, tmp_path, step=1)
    with pytest.raises(CheckpointError, match="global_step1: already exists"):
        export_neox_checkpoint(model, config, tmp_path, step=1)
    assert sorted(os.listdir(tmp_path)) == ["global_step1", "latest"]


def test_export_rejects_tp_size_that_does_not_divide_heads(tmp_path):
    config = tiny_config()
    with pytest.raises(CheckpointError, match="tp_size=3"):
        export_neox_checkpoint(transformers.GPTNeoXForCausalLM(config), config, tmp_path, tp_size=3)


# ---------------------------------------------------------------- bad input


@pytest.fixture
def pipeline_tp2(tmp_path):
    config = tiny_config()
    step_dir = write_neox_checkpoint(random_neox_shards(config, tp=2), tmp_path, "pipeline")
    return config, tmp_path, step_dir


def test_truncated_file_names_the_file(pipeline_tp2):
    config, root, step_dir = pipeline_tp2
    path = step_dir / "layer_03-model_01-model_states.pt"
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(CheckpointError, match="layer_03-model_01-model_states.pt.*truncated or corrupt"):
        load_neox_state_dict(root, config)


def test_missing_layer_file_names_the_file(pipeline_tp2):
    config, root, step_dir = pipeline_tp2
    (step_dir / "layer_02-model_00-model_states.pt").unlink()
    with pytest.raises(CheckpointError, match="layer_02-model_00-model_states.pt: file is missing"):
        load_neox_state_dict(root, config)


def test_missing_tp_rank_is_reported(tmp_path):
    config = tiny_config()
    step_dir = write_neox_checkpoint(random_neox_shards(config, tp=2), tmp_path, "sequential")
    (step_dir / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[0\] are missing"):
        load_neox_state_dict(tmp_path, config)


def test_vocab_mismatch_names_the_key_and_config_value(pipeline_tp2):
    _, root, _ = pipeline_tp2
    with pytest.raises(CheckpointError, match=r"gpt_neox.embed_in.weight' has shape \(128, 64\).*vocab_size=256"):
        load_neox_state_dict(root, tiny_config(vocab_size=256))


def test_layer_count_mismatch_names_the_missing_file(pipeline_tp2):
    _, root, step_dir = pipeline_tp2
    with pytest.raises(CheckpointError, match="layer_04-model_00-model_states.pt: file is missing"):
        load_neox_state_dict(root, tiny_config(num_hidden_layers=3))


@pytest.mark.parametrize("layout", ["pipeline", "sequential"])
def test_untied_checkpoint_read_with_tied_config_is_an_error(tmp_path, layout):
    write_neox_checkpoint(random_neox_shards(tiny_config(tied=False), tp=1), tmp_path, layout)
    with pytest.raises(CheckpointError, match=r"layer index\(es\) \[6\].*tie_word_embeddings=False"):
        load_neox_state_dict(tmp_path, tiny_config(tied=True))


def test_replicated_norm_disagreeing_across_ranks_is_an_error(pipeline_tp2):
    config, root, step_dir = pipeline_tp2
    path = step_dir / "layer_02-model_01-model_states.pt"
    params = torch.load(path, weights_only=True)
    params["input_layernorm.weight"] += 1e-3
    torch.save(params, path)
    with pytest.raises(CheckpointError, match="layer_02-model_.*input_layernorm.weight.*differs"):
        load_neox_state_dict(root, config)


def test_unrepresentable_parameter_is_an_error(pipeline_tp2):
    config, root, step_dir = pipeline_tp2
    path = step_dir / "layer_02-model_00-model_states.pt"
    params = torch.load(path, weights_only=True)
    params["input_layernorm.scale"] = params.pop("input_layernorm.weight")  # RMSNorm
    torch.save(params, path)
    with pytest.raises(CheckpointError, match="unexpected parameter 'input_layernorm.scale'"):
        load_neox_state_dict(root, config)


def test_latest_naming_a_missing_folder_is_an_error(tmp_path):
    (tmp_path / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match="latest names 'global_step9'"):
        load_neox_state_dict(tmp_path, tiny_config())


def test_pickle_with_numpy_and_args_needs_trust_pickle(tmp_path):
    # What GPT-NeoX really writes into mp_rank_XX_model_states.pt next to the weights.
    config = tiny_config(parallel_residual=False)
    ranks = random_neox_shards(config, tp=2)
    extras = {"np_rng_state": np.random.get_state(), "args": argparse.Namespace(lr=1e-4), "iteration": 7}
    write_neox_checkpoint(ranks, tmp_path, "sequential", rank_extras=extras)

    needs_trust = r"mp_rank_00_model_states.pt: .*trust_pickle=True \(CLI: --trust-pickle\)"
    with pytest.raises(CheckpointError, match=needs_trust):
        load_neox_state_dict(tmp_path, config)

    model = neox_to_hf_model(tmp_path, config, trust_pickle=True)
    expected = neox_reference_logits(ranks, config, INPUT_IDS)
    torch.testing.assert_close(hf_logits(model, INPUT_IDS), expected, atol=1e-5, rtol=0)


def test_legacy_non_zip_files_load(tmp_path):
    # Checkpoints from torch < 1.6 are not zip files, so they cannot be mmapped.
    config = tiny_config(tied=True)
    ranks = random_neox_shards(config, tp=1)
    step_dir = tmp_path / "global_step0"
    step_dir.mkdir()
    for idx, params in ranks[0].items():
        torch.save(params, step_dir / f"layer_{idx:02d}-model_00-model_states.pt", _use_new_zipfile_serialization=False)
    model = neox_to_hf_model(step_dir, config)
    torch.testing.assert_close(hf_logits(model, INPUT_IDS), neox_reference_logits(ranks, config, INPUT_IDS),
                               atol=1e-5, rtol=0)
