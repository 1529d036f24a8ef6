"""The typed recipe: one dataclass tree, loaded from YAML, overridden from the command line, validated once.

A run is "defaults + a recipe file (ours or GPT-NeoX's) + `--section.key value` overrides", resolved in this package
and nowhere else; every other module receives plain values from the resulting `Recipe`. Errors name the key, the bad
value and the fix (the closest valid key for a typo).

Where things live:
- `keys`: the dataclasses, the one place each key is described (type, default, `help`, GPT-NeoX name);
- `loading`: recipe YAML files (duplicate keys refused); `overrides`: `--section.key value` and the merge of trees;
- `build`: a plain dict → a typed `Recipe`, precision settled (`precision`), then validated;
- `validate`: the rules between keys, with `model_rules` (families, MoE), `parallel_rules` (pipeline, sequence,
  context, expert parallelism, FSDP2), `train_batch` (GPT-NeoX's global batch) and `checks` (optimizer ranges);
- `args`: the command line → `Recipe`; `launcher`: what the launch says (world size, accelerate's config);
  `reference`: the key reference and `--help`, rendered from `keys`.

The keys, the build and the rules import nothing of neox_hf but the error type; `precision` reads the machine
(`hardware`) and the checkpoint a run resumes, `args` GPT-NeoX files (`neox_yaml`), all layers below this one.
"""

from neox_hf.recipe.build import recipe_from_dict, settled
from neox_hf.recipe.keys import (LLAMA_DEFAULTS, CurriculumConfig, DataConfig, DataSource, Fp8Config, ModelConfig,
                                 OutputConfig, ParallelConfig, PeftConfig, PushToHubConfig, Recipe, TokenizerConfig,
                                 TrainConfig)
from neox_hf.recipe.loading import load_yaml_file
from neox_hf.recipe.model_rules import HIDDEN_ACTIVATIONS
from neox_hf.recipe.overrides import merge_dicts, parse_overrides
from neox_hf.recipe.train_batch import (accumulation_for_train_batch, data_parallel_for_train_batch,
                                        train_batch_disagreement)
from neox_hf.recipe.validate import TRACKERS, validate

__all__ = [
    "CurriculumConfig", "DataConfig", "DataSource", "Fp8Config", "HIDDEN_ACTIVATIONS", "LLAMA_DEFAULTS", "ModelConfig",
    "OutputConfig", "ParallelConfig", "PeftConfig", "PushToHubConfig", "Recipe", "TRACKERS", "TokenizerConfig",
    "TrainConfig", "accumulation_for_train_batch", "data_parallel_for_train_batch", "load_yaml_file", "merge_dicts",
    "parse_overrides", "recipe_from_dict", "settled", "train_batch_disagreement", "validate",
]
