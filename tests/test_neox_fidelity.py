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
from neox_hf.train.args import parse_run_args


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
