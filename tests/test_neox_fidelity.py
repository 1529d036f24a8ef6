"""GPT-NeoX configs mean here what they mean in GPT-NeoX: the run's seed orders the data wherever the data path comes
from, train_batch_size follows GPT-NeoX's batch rule, and a key GPT-NeoX would refuse is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml

import neox_order_reference as ref
from test_neox_order import ACC, DP, ITERS, MICRO, SEQ, corpus, write_neox_config  # noqa: F401  (corpus: fixture)

from neox_hf.batches import recipe_for_batches, step_batches
from neox_hf.errors import RecipeError
from neox_hf.neox_yaml import load_neox_recipe_dict
from neox_hf.train.args import parse_run_args
from tests.conftest import SHARED_DATA


def without_key(config: str, key: str, out) -> str:
    """The GPT-NeoX config `config` with `key` removed (JSON is a GPT-NeoX config too)."""
    raw = yaml.safe_load(open(config).read())
    del raw[key]
    out.write_text(json.dumps(raw))
    return str(out)


def test_config_seed_orders_the_batches_when_the_data_path_comes_from_the_command_line(tmp_path, corpus):  # noqa: F811
    prefix, docs = corpus
    written = write_neox_config(tmp_path, prefix, seed=42)
    pathless = without_key(written, "data-path", tmp_path / "pathless.yml")
    expected = ref.train_rows(docs, "969,30,1", ITERS, MICRO * ACC * DP, SEQ, seed=42)

    def rows(recipe):
        return step_batches(recipe, DP, 0, ITERS)

    np.testing.assert_array_equal(rows(recipe_for_batches([written], None, None)), expected)
    # `neox_hf batches CONFIG --data-path PREFIX`
    np.testing.assert_array_equal(rows(recipe_for_batches([pathless], prefix, None)), expected)
    # run_clm_neox.py CONFIG --data.sources ...: the config's seed, not the recipe default
    recipe = parse_run_args([pathless, "--data.sources", f"[{{path: {prefix}, format: indexed}}]",
                             "--data.order", "gpt-neox", "--data.split", "969,30,1"]).recipe
    assert (recipe.data.seed, recipe.train.seed) == (42, 42)
    np.testing.assert_array_equal(rows(recipe), expected)


def neox_file(tmp_path, text: str, name: str = "run.yml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text,closest", [
    ('{"num-layer": 2, "hidden-size": 64, "num-attention-heads": 4}', "`num-layers`"),
    ('{"num_layers": 2, "hiden_size": 64}', "`hidden_size`"),
    ('{"num_layers": 2, "train_micro_batch_size_per_gp": 4}', "`train_micro_batch_size_per_gpu`"),
])
def test_a_key_gpt_neox_does_not_know_is_refused_naming_the_closest(tmp_path, text, closest):
    # GPT-NeoX's NeoXArgs refuses an unknown key; a note at start-up would train a different model (2 layers → 6)
    with pytest.raises(RecipeError, match=f"did you mean {closest}"):
        parse_run_args([neox_file(tmp_path, text)])


def test_gpt_neox_keys_without_a_counterpart_here_stay_notes(tmp_path):
    text = '{"num_layers": 2, "finetune": true, "log_dir": "logs", "text_gen_type": "unconditional", "gptj_residual": false}'
    notices = parse_run_args([neox_file(tmp_path, text)]).notices
    assert any("log_dir" in n for n in notices)  # no effect here
    untranslated = next(n for n in notices if "finetune" in n)
    assert "text_gen_type" in untranslated and "gptj_residual" in untranslated  # an older GPT-NeoX's name is known too


@pytest.mark.parametrize("path", sorted(SHARED_DATA.glob("neox*-configs/**/*.yml")), ids=lambda p: p.parent.name + "/" + p.name)
def test_every_shipped_gpt_neox_config_uses_only_known_keys(path):
    try:
        load_neox_recipe_dict([path])
    except RecipeError as err:  # the Llama family: refused for its architecture, as before
        assert "is not supported by neox_hf" in str(err) and "did you mean" not in str(err), err
