"""`train.objective: rm`: a reward model (TRL's `RewardTrainer`, GPT-NeoX's `train_impl: rm`).

The model is stock `transformers.GPTNeoXForSequenceClassification` (one label, `config.pad_token_id` set): the reward
of a sequence is its score at the last non-pad token, transformers' own pooling, through the model's forward. Loss per
pair: −log σ(r_chosen − r_rejected). Metrics (TRL's names), per pair: accuracy (r_c > r_r), margin (r_c − r_r),
mean_reward ((r_c + r_r) / 2).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from neox_hf.objectives.base import Objective, ObjectiveLoss
from neox_hf.ops.context_parallel import counts_sequences, last_token_value
from neox_hf.ops.loss import SEQUENCE_CHUNK, causal_lm_module, decoder_hidden_states

METRICS = ("accuracy", "margin", "mean_reward")


def sequence_rewards(model, batch: dict) -> torch.Tensor:
    """[rows] rewards: the sequence-classification model's score at each row's last non-pad token. A
    context-parallel chunk runs the decoder and the score head on its chunk; the score at the last non-pad token of
    the whole sequence comes from the rank that holds it (`last_token_value`: transformers' pooling)."""
    module = causal_lm_module(model)  # the model inside a DeepSpeed engine or a PEFT wrapper
    if SEQUENCE_CHUNK in batch:
        scores = module.score(decoder_hidden_states(module, batch))
        return last_token_value(scores, batch, module.config.pad_token_id)[:, 0]
    return module(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits[:, 0]


class RewardObjective(Objective):
    name, unit, metric_names = "rm", "pair", METRICS
    rows_per_sample = 2

    def units(self, batch: dict) -> torch.Tensor:
        """Pairs of the batch; 0 on a context-parallel rank other than its group's first (`counts_sequences`)."""
        return torch.tensor(batch["input_ids"].shape[0] // 2 * counts_sequences(batch), device=batch["input_ids"].device)

    def loss(self, model, batch: dict, *, fused: bool = True, z_loss: float = 0.0) -> ObjectiveLoss:
        """`fused` and `z_loss` concern the LM head, which a reward model does not have."""
        rewards = sequence_rewards(model, batch)
        chosen, rejected = rewards.chunk(2)
        losses = -F.logsigmoid(chosen - rejected)
        with torch.no_grad():
            metrics = {"accuracy": (chosen > rejected).float().sum(), "margin": (chosen - rejected).sum(),
                       "mean_reward": ((chosen + rejected) / 2).sum()}
        counted = float(counts_sequences(batch))  # context parallelism: the group's first rank reports
        return ObjectiveLoss(loss_sum=losses.sum() * counted, units=self.units(batch),
                             metric_sums={k: v.detach() * counted for k, v in metrics.items()})


def build_reward_model(recipe, tokenizer):
    """GPTNeoXForSequenceClassification (num_labels 1, pad_token_id = the tokenizer's) in fp32 for a recipe:
    from `model.from_pretrained` (a causal-LM GPTNeoX folder: its decoder, and a new score head initialised as
    transformers does, under `train.seed`; a saved reward model loads whole), or from the recipe's `model` section
    with transformers' initialisation, the vocabulary padded as for the language model."""
    with torch.random.fork_rng(devices=[]):  # seeded, and the caller's RNG stream is left as it was
        torch.manual_seed(recipe.train.seed)
        model = _reward_model(recipe, tokenizer)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


def _reward_model(recipe, tokenizer):
    from transformers import AutoModelForSequenceClassification, GPTNeoXForSequenceClassification

    from neox_hf.model.vocab import check_vocab_covers_tokenizer, padded_vocab_size
    from neox_hf.model import config_from_recipe
    from neox_hf.model.folder import from_pretrained_whole

    m = recipe.model
    if m.from_pretrained:
        # a causal-LM folder has no score head: the new head is this recipe's to initialise, nothing else is
        model = from_pretrained_whole(
            AutoModelForSequenceClassification, m.from_pretrained, new_weights=("score.",), num_labels=1,
            pad_token_id=tokenizer.pad_token_id, dtype=torch.float32, attn_implementation=m.attn_implementation)
        check_vocab_covers_tokenizer(model.config.vocab_size, tokenizer, where=m.from_pretrained)
    else:
        vocab = m.vocab_size or padded_vocab_size(len(tokenizer), m.make_vocab_size_divisible_by,
                                                  recipe.parallel.tensor_parallel)
        config = config_from_recipe(m, vocab_size=vocab, bos_token_id=tokenizer.bos_token_id,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        config = _stock_config(config)
        config.num_labels = 1
        config._attn_implementation = m.attn_implementation
        model = GPTNeoXForSequenceClassification(config)
    return model


def _stock_config(config):
    """NeoXConfig → stock GPTNeoXConfig (the saved folder must load without neox_hf)."""
    from transformers import GPTNeoXConfig

    values = {k: v for k, v in config.to_dict().items() if k not in ("init_method", "output_layer_init_method")}
    values.pop("model_type", None)
    return GPTNeoXConfig(**values)
