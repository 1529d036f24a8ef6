"""NeoXForCausalLM against stock transformers GPTNeoXForCausalLM: same logits, keys, files, generation, init."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM

from neox_hf.model import NeoXConfig, NeoXForCausalLM, config_from_recipe, init_std
from neox_hf.recipe import ModelConfig

PYTHIA_SHAPES = {
    "pythia-14m": dict(num_hidden_layers=6, hidden_size=128, num_attention_heads=4, intermediate_size=512),
    "pythia-70m": dict(num_hidden_layers=6, hidden_size=512, num_attention_heads=8, intermediate_size=2048),
}


def stock_config(shape: str, **overrides) -> GPTNeoXConfig:
    kwargs = dict(PYTHIA_SHAPES[shape], vocab_size=50304, max_position_embeddings=2048, rotary_pct=0.25,
                  use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    kwargs.update(overrides)
    return GPTNeoXConfig(**kwargs)


@pytest.fixture(scope="module", params=list(PYTHIA_SHAPES))
def stock_folder(request, tmp_path_factory):
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(stock_config(request.param)).eval()
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return folder


def input_ids(vocab=50277, shape=(2, 24), seed=1):
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def test_stock_folder_loads_into_ours_with_equal_logits(stock_folder):
    assert "embed_out.weight" in load_file(stock_folder / "model.safetensors")  # stock files keep the old name
    stock = GPTNeoXForCausalLM.from_pretrained(stock_folder).eval()
    ours = NeoXForCausalLM.from_pretrained(stock_folder).eval()
    assert torch.equal(ours.lm_head.weight, stock.lm_head.weight)  # not a random head (the rename reached our class)
    ids = input_ids()
    with torch.no_grad():
        assert (ours(ids).logits - stock(ids).logits).abs().max().item() <= 1e-5


def test_our_folder_loads_in_stock_transformers(stock_folder, tmp_path):
    ours = NeoXForCausalLM.from_pretrained(stock_folder).eval()
    ours.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt_neox"
    assert config["architectures"] == ["GPTNeoXForCausalLM"]
    assert set(load_file(tmp_path / "model.safetensors")) == set(load_file(stock_folder / "model.safetensors"))
    stock = AutoModelForCausalLM.from_pretrained(tmp_path).eval()  # no trust_remote_code
    assert type(stock) is GPTNeoXForCausalLM
    ids = input_ids()
    with torch.no_grad():
        assert (ours(ids).logits - stock(ids).logits).abs().max().item() <= 1e-5


def test_greedy_generation_identical(stock_folder):
    stock = GPTNeoXForCausalLM.from_pretrained(stock_folder).eval()
    ours = NeoXForCausalLM.from_pretrained(stock_folder).eval()
    prompt = input_ids(shape=(1, 8))
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours.generate(prompt, **kwargs), stock.generate(prompt, **kwargs))


def test_sdpa_is_the_default_attention(stock_folder):
    assert NeoXForCausalLM.from_pretrained(stock_folder).config._attn_implementation == "sdpa"


def test_gradient_checkpointing_gives_equal_gradients():
    torch.manual_seed(0)
    config = NeoXConfig(**stock_config("pythia-14m", vocab_size=512).to_dict())
    plain = NeoXForCausalLM(config).train()
    checkpointed = NeoXForCausalLM(config).train()
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.activation_checkpointing_enable()
    assert checkpointed.is_activation_checkpointing
    ids = input_ids(vocab=512)
    for model in (plain, checkpointed):
        model(ids, labels=ids).loss.backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6, rtol=0), name


@pytest.fixture(scope="module")
def tiny_stock(tmp_path_factory):
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(stock_config("pythia-14m", vocab_size=1024)).eval()
    return model


def test_sharded_safetensors_load(tiny_stock, tmp_path):
    tiny_stock.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    ours = NeoXForCausalLM.from_pretrained(tmp_path).eval()
    ids = input_ids(vocab=1024)
    with torch.no_grad():
        assert (ours(ids).logits - tiny_stock(ids).logits).abs().max().item() <= 1e-5


def _released_style_state_dict(model) -> dict:
    """Released Pythia .bin files store `embed_out.weight`, as GPT-NeoX's converter wrote them."""
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state["embed_out.weight"] = state.pop("lm_head.weight")
    return state


def test_legacy_pytorch_model_bin_and_sharded_bin(tiny_stock, tmp_path):
    tiny_stock.config.save_pretrained(tmp_path / "single")
    torch.save(_released_style_state_dict(tiny_stock), tmp_path / "single" / "pytorch_model.bin")
    state = _released_style_state_dict(tiny_stock)
    names = sorted(state)
    half = len(names) // 2
    shards = {"pytorch_model-00001-of-00002.bin": names[:half], "pytorch_model-00002-of-00002.bin": names[half:]}
    tiny_stock.config.save_pretrained(tmp_path / "sharded")
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, tmp_path / "sharded" / shard)
    index = {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}
    (tmp_path / "sharded" / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    ids = input_ids(vocab=1024)
    for folder in ("single", "sharded"):
        ours = NeoXForCausalLM.from_pretrained(tmp_path / folder).eval()
        with torch.no_grad():
            assert (ours(ids).logits - tiny_stock(ids).logits).abs().max().item() <= 1e-5, folder


class _NotAWeight:
    def __reduce__(self):
        return (print, ("unpickled arbitrary code",))


def test_legacy_bin_with_arbitrary_pickle_is_refused(tiny_stock, tmp_path):
    tiny_stock.config.save_pretrained(tmp_path)
    state = _released_style_state_dict(tiny_stock)
    state["evil"] = _NotAWeight()
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="(?i)weights_only|unpickl|Unsupported"):
        NeoXForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_stored_weights(tiny_stock, tmp_path, dtype):
    half = {k: v.to(dtype).contiguous() for k, v in _released_style_state_dict(tiny_stock).items()}
    config = copy.deepcopy(tiny_stock.config)
    config.dtype = dtype  # released configs record the stored dtype ("torch_dtype": "float16")
    config.save_pretrained(tmp_path)
    save_file(half, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ours = NeoXForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert ours.gpt_neox.embed_in.weight.dtype == torch.float32
    assert torch.equal(ours.lm_head.weight, half["embed_out.weight"].float())
    native = NeoXForCausalLM.from_pretrained(tmp_path, dtype="auto")
    assert native.gpt_neox.embed_in.weight.dtype == dtype


def test_legacy_config_keys(tmp_path):
    legacy = {
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 128, "rotary_pct": 0.5, "rotary_emb_base": 5000,
        "use_parallel_residual": False, "tie_word_embeddings": True, "max_position_embeddings": 64,
    }
    (tmp_path / "config.json").write_text(json.dumps(legacy))
    config = NeoXConfig.from_pretrained(tmp_path)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    assert config.rope_parameters["rope_theta"] == 5000
    assert config.use_parallel_residual is False and config.tie_word_embeddings is True
    model = NeoXForCausalLM(config)
    assert model.lm_head.weight is model.gpt_neox.embed_in.weight
    stock = GPTNeoXForCausalLM(GPTNeoXConfig.from_pretrained(tmp_path))
    stock.load_state_dict(model.state_dict())
    ids = input_ids(vocab=128, shape=(1, 16))
    with torch.no_grad():
        assert (model(ids).logits - stock(ids).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    "init_method,output_method", [("small_init", "wang_init"), ("normal", "scaled_normal"), ("wang_init", "small_init")]
)
def test_init_methods_produce_gpt_neox_stds(init_method, output_method):
    hidden, layers = 256, 4
    config = config_from_recipe(
        ModelConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=4, init_method=init_method,
                    output_layer_init_method=output_method),
        vocab_size=4096,
    )
    torch.manual_seed(0)
    model = NeoXForCausalLM(config)
    expected = {
        "small_init": math.sqrt(2 / (5 * hidden)), "wang_init": 2 / layers / math.sqrt(hidden),
        "normal": 0.02, "scaled_normal": 0.02 / math.sqrt(2 * layers),
    }
    assert init_std(init_method, hidden_size=hidden, num_layers=layers) == pytest.approx(expected[init_method])
    layer = model.gpt_neox.layers[0]
    for weight, method in [
        (layer.attention.query_key_value.weight, init_method), (layer.mlp.dense_h_to_4h.weight, init_method),
        (model.gpt_neox.embed_in.weight, init_method), (model.lm_head.weight, init_method),
        (layer.attention.dense.weight, output_method), (layer.mlp.dense_4h_to_h.weight, output_method),
    ]:
        assert weight.std().item() == pytest.approx(expected[method], rel=0.03), method
    assert torch.count_nonzero(layer.attention.query_key_value.bias) == 0
    assert torch.all(layer.input_layernorm.weight == 1)
