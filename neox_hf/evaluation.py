"""`neox_hf eval`: token-weighted loss and perplexity of a saved model (full or adapter folder) on a local file; with
`--objective dpo` the DPO loss and reward accuracy of a policy against a reference on preference pairs, with
`--objective kto` the KTO loss, KL estimate and rewards of a policy against a reference on unpaired completions, with
`--objective rm` the pairwise loss and accuracy of a reward model.

Gap filled: transformers' `Trainer.evaluate` averages per-batch mean losses (wrong for dynamically padded or
prompt-masked batches) and the Hub's `perplexity` metric downloads and runs its own model. Here batches come from
our data layer (same `template` / `prompt_template` / `text_key` options as training, labels already aligned),
every labelled token counts once, and the shipped `evaluate` module `neox_hf/metrics/perplexity` turns the
(loss sum, token count) pairs into perplexity offline. With a prompt template the answer-only loss is reported
beside the loss over the whole text.

Preference pairs are read, tokenised and batched by `neox_hf.data.preference` (as training reads them) and scored by
the training objectives of `neox_hf.objectives` (TRL's formulas): `dpo_loss` is the mean over pairs of the sigmoid
DPO loss, `rewards_accuracy` the fraction of pairs whose implicit reward β(π − ref) is higher for the chosen answer;
`rm_loss` the mean of −log σ(r_chosen − r_rejected), `accuracy` the fraction with r_chosen > r_rejected;
`kto_loss` the mean over examples of TRL's KTO loss, its KL estimate taken per batch of `--batch-size` examples (the
KL sequences pair each prompt with the previous example's completion of the batch, as in training).

For lm-evaluation-harness benchmarks use `lm_eval --model hf --model_args pretrained=FOLDER` on a merged folder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import evaluate
import torch
import torch.nn.functional as F

from neox_hf.data import build_eval_loader
from neox_hf.errors import DataError, UsageError, print_to_stderr
from neox_hf.inference import load_for_inference
from neox_hf.io import atomic_write_text
from neox_hf.recipe import DataConfig, DataSource

PERPLEXITY_METRIC = Path(__file__).resolve().parent / "metrics" / "perplexity"
ALL_BATCHES = 10**9
OBJECTIVES = ("lm", "dpo", "rm", "kto")


def load_perplexity_metric():
    """The shipped perplexity module, loaded by path (no Hub access)."""
    return evaluate.load(str(PERPLEXITY_METRIC))


def evaluate_model(model_path, data_file, *, tokenizer_path: str | None = None, template: str | None = None,
                   prompt_template: str | None = None, text_key: str = "text", seq_length: int | None = None,
                   batch_size: int = 8, max_batches: int | None = None, device: str = "auto") -> dict:
    """{"loss", "perplexity", "tokens"} over every token of each document, plus "answer_loss",
    "answer_perplexity", "answer_tokens" (prompt tokens masked) when `prompt_template` is given."""
    model, tokenizer = load_for_inference(model_path, tokenizer_path, device=device)
    seq_length = seq_length or model.config.max_position_embeddings
    source = DataSource(path=str(data_file), text_key=text_key, template=template)
    scores = _score(model, _eval_batches(source, tokenizer, seq_length, batch_size, max_batches))
    result = {"model": str(model_path), "data": str(data_file), **scores}
    if prompt_template is not None:
        answer_source = DataSource(path=str(data_file), text_key=text_key, template=template,
                                   prompt_template=prompt_template)
        answer = _score(model, _eval_batches(answer_source, tokenizer, seq_length, batch_size, max_batches))
        result.update({f"answer_{key}": value for key, value in answer.items()})
    return result


def _eval_batches(source: DataSource, tokenizer, seq_length: int, batch_size: int, max_batches: int | None) -> list[dict]:
    data_cfg = DataConfig(validation=[source], mode="pad", shuffle=False)
    batches = build_eval_loader(data_cfg, tokenizer, seq_length=seq_length, micro_batch_size=batch_size,
                                max_batches=max_batches or ALL_BATCHES)
    if not batches:
        raise DataError(f"{source.path}: no document with at least two tokens to evaluate "
                        f"(text_key {source.text_key!r}, template {source.template!r})")
    return batches


@torch.no_grad()
def batch_loss_sum(model, batch: dict) -> tuple[float, int]:
    """(Σ cross-entropy over labelled tokens, number of labelled tokens) of one batch, in float64."""
    inputs = {k: batch[k].to(model.device) for k in ("input_ids", "attention_mask", "position_ids") if k in batch}
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"].to(model.device)
    losses = F.cross_entropy(logits.double().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return float(losses), int((labels != -100).sum())


def _score(model, batches: list[dict]) -> dict:
    metric = load_perplexity_metric()
    for batch in batches:
        loss_sum, tokens = batch_loss_sum(model, batch)
        metric.add_batch(losses=[loss_sum], token_counts=[tokens])
    scores = metric.compute()
    return {"loss": scores["mean_loss"], "perplexity": scores["perplexity"], "tokens": scores["tokens"]}


# ----------------------------------------------------------------------------------------------------------------
# `neox_hf eval MODEL --data FILE`
# ----------------------------------------------------------------------------------------------------------------


def add_eval_arguments(parser) -> None:
    parser.add_argument("model", help="model folder, or adapter folder of a LoRA run (rm: a reward-model folder)")
    parser.add_argument("--data", required=True, help="jsonl / json / txt / parquet file (or glob) to evaluate on "
                        "(dpo / rm: rows of prompt, chosen, rejected; kto: prompt, completion, label)")
    parser.add_argument("--objective", choices=OBJECTIVES, default="lm",
                        help="lm (default): loss and perplexity; dpo: DPO loss and reward accuracy against "
                        "--reference; kto: KTO loss, KL and rewards against --reference; rm: a reward model's "
                        "pairwise loss and accuracy")
    parser.add_argument("--reference", default=None,
                        help="dpo / kto: the reference model folder (the run's starting model)")
    parser.add_argument("--beta", type=float, default=0.1, help="dpo / kto: β of the loss (default 0.1)")
    parser.add_argument("--desirable-weight", type=float, default=1.0, help="kto: λ_D (default 1)")
    parser.add_argument("--undesirable-weight", type=float, default=1.0, help="kto: λ_U (default 1)")
    parser.add_argument("--completion-key", default="completion", help="kto: the completion column")
    parser.add_argument("--label-key", default="label", help="kto: the boolean desirable column")
    parser.add_argument("--prompt-key", default="prompt", help="dpo / rm: the prompt column (default: prompt)")
    parser.add_argument("--chosen-key", default="chosen", help="dpo / rm: the preferred answer (default: chosen)")
    parser.add_argument("--rejected-key", default="rejected", help="dpo / rm: the other answer (default: rejected)")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    parser.add_argument("--tokenizer", default=None, help="tokenizer JSON or folder (default: the model folder's)")
    parser.add_argument("--text-key", default="text", help="jsonl field holding the text (default: text)")
    parser.add_argument("--template", default=None, help='join fields, e.g. "Question: {question}\\nAnswer: {answer}"')
    parser.add_argument("--prompt-template", default=None,
                        help='prompt part, masked for the answer-only loss, e.g. "Question: {question}\\nAnswer: "')
    parser.add_argument("--seq-length", type=int, default=None, help="truncate documents (default: model context)")
    parser.add_argument("--batch-size", type=int, default=8, help="documents per forward pass")
    parser.add_argument("--max-batches", type=int, default=None, help="evaluate only the first N batches")
    parser.add_argument("--output", default=None, help="also write the results to this JSON file")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto (default): the GPU where torch sees one, else the CPU")


def run_eval(args) -> int:
    for flag, value in (("--batch-size", args.batch_size), ("--seq-length", args.seq_length),
                        ("--max-batches", args.max_batches)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be ≥ 1, got {value}")
    if args.objective != "lm":
        return _run_preference_eval(args)
    if args.reference is not None:
        raise UsageError("--reference is for --objective dpo or kto; drop it, or add --objective dpo / kto")
    result = evaluate_model(args.model, args.data, tokenizer_path=args.tokenizer, template=_unescape(args.template),
                            prompt_template=_unescape(args.prompt_template), text_key=args.text_key,
                            seq_length=args.seq_length, batch_size=args.batch_size, max_batches=args.max_batches,
                            device=args.device)
    return _report(args, result, format_eval_result(result))


def _report(args, result: dict, text: str) -> int:
    print(json.dumps(result) if args.json else text)
    if args.output:
        atomic_write_text(args.output, json.dumps(result, indent=2) + "\n")
    return 0


def _unescape(template: str | None) -> str | None:
    """Shells pass `\\n` literally; templates mean a newline."""
    return None if template is None else template.replace("\\n", "\n")


def format_eval_result(result: dict) -> str:
    lines = [f"loss {result['loss']:.4f}  perplexity {_finite(result['perplexity'])}  over {result['tokens']:,} tokens"]
    if "answer_loss" in result:
        lines.append(f"answer-only loss {result['answer_loss']:.4f}  perplexity {_finite(result['answer_perplexity'])}"
                     f"  over {result['answer_tokens']:,} tokens")
    return "\n".join(lines)


def _finite(value: float) -> str:
    return f"{value:.2f}" if math.isfinite(value) else "inf"


# ----------------------------------------------------------------------------------------------------------------
# `neox_hf eval OUT --objective dpo --reference BASE --data pairs.jsonl` / `--objective rm`
# ----------------------------------------------------------------------------------------------------------------


def _run_preference_eval(args) -> int:
    if args.objective in ("dpo", "kto") and not args.reference:
        raise UsageError(f"--objective {args.objective} needs --reference BASE: the reference model folder (the run's "
                         "starting model, its `model.from_pretrained`)")
    if args.objective == "rm" and args.reference:
        raise UsageError("--reference is for --objective dpo; a reward model is scored alone: drop --reference")
    for flag, value in (("--beta", args.beta), ("--desirable-weight", args.desirable_weight),
                        ("--undesirable-weight", args.undesirable_weight)):
        if not (value > 0 and math.isfinite(value)):
            raise UsageError(f"{flag} must be a finite number > 0, got {value}")
    source = DataSource(path=str(args.data), prompt_key=args.prompt_key, chosen_key=args.chosen_key,
                        rejected_key=args.rejected_key, completion_key=args.completion_key, label_key=args.label_key)
    _check_pairs(source, unpaired=args.objective == "kto")
    if args.objective == "kto":
        if args.batch_size < 2:
            raise UsageError("--objective kto estimates its KL term from the other examples of a batch: give "
                             "--batch-size ≥ 2")
        result = evaluate_kto(args.model, args.reference, source, beta=args.beta,
                              desirable_weight=args.desirable_weight, undesirable_weight=args.undesirable_weight,
                              tokenizer_path=args.tokenizer, seq_length=args.seq_length, batch_size=args.batch_size,
                              max_batches=args.max_batches, device=args.device)
        text = (f"kto_loss {result['kto_loss']:.4f}  kl {result['kl']:.4f}  rewards_chosen "
                f"{result['rewards_chosen']:.4f}  rewards_rejected {result['rewards_rejected']:.4f}  over "
                f"{result['examples']:,} examples (beta {args.beta})")
    elif args.objective == "dpo":
        result = evaluate_dpo(args.model, args.reference, source, beta=args.beta, tokenizer_path=args.tokenizer,
                              seq_length=args.seq_length, batch_size=args.batch_size, max_batches=args.max_batches,
                              device=args.device)
        text = (f"dpo_loss {result['dpo_loss']:.4f}  rewards_accuracy {result['rewards_accuracy']:.4f}  "
                f"rewards_margin {result['rewards_margin']:.4f}  over {result['pairs']:,} pairs (beta {args.beta})")
    else:
        result = evaluate_reward_model(args.model, source, tokenizer_path=args.tokenizer, seq_length=args.seq_length,
                                       batch_size=args.batch_size, max_batches=args.max_batches, device=args.device)
        text = (f"rm_loss {result['rm_loss']:.4f}  accuracy {result['accuracy']:.4f}  margin {result['margin']:.4f}  "
                f"over {result['pairs']:,} pairs")
    return _report(args, result, text)


def _check_pairs(source: DataSource, unpaired: bool = False) -> None:
    """The pairs file is read before any model is loaded: a wrong path or column costs no load."""
    from neox_hf.data.preference import read_pairs

    try:
        # as training refuses
        read_pairs([source], max_skipped_fraction=DataConfig().max_skipped_fraction, unpaired=unpaired)
    except DataError as err:
        message = str(err).replace("set `prompt_key` / `chosen_key` / `rejected_key` on the source",
                                   "pass --prompt-key / --chosen-key / --rejected-key")
        message = message.replace("set `prompt_key` / `completion_key` / `label_key` on the source",
                                  "pass --prompt-key / --completion-key / --label-key")
        message = message.replace(", or raise `data.max_skipped_fraction` to accept it", "")
        raise DataError(message) from None


def _pair_batches(source: DataSource, tokenizer, objective: str, seq_length: int, batch_size: int,
                  max_batches: int | None) -> list[dict]:
    from neox_hf.data.preference import build_preference_eval_loader

    data_cfg = DataConfig(validation=[source], mode="pad", shuffle=False)
    return build_preference_eval_loader(data_cfg, tokenizer, seq_length=seq_length, micro_batch_size=batch_size,
                                        max_batches=max_batches or ALL_BATCHES, objective=objective)


def _on(batch: dict, device) -> dict:
    return {k: v.to(device) for k, v in batch.items()}


def _sums(objective, model, batches: list[dict]) -> tuple[float, dict, int]:
    """(Σ loss, Σ metrics, pairs) of an objective over batches, in float64."""
    loss_sum, metric_sums, pairs = 0.0, {}, 0
    with torch.no_grad():
        for batch in batches:
            out = objective.loss(model, batch)
            loss_sum += float(out.loss_sum)
            pairs += int(out.units)
            for key, value in out.metric_sums.items():
                metric_sums[key] = metric_sums.get(key, 0.0) + float(value)
    return loss_sum, metric_sums, pairs


def _policy_reference_and_batches(model_path, reference_path, source: DataSource, objective: str, tokenizer_path,
                                  seq_length, batch_size: int, max_batches, device: str):
    """(policy, reference, batches on the policy's device) of a preference evaluation. The data is tokenised once, by
    the policy's tokenizer; the reference folder needs none of its own (`check_reference` compares them)."""
    model, tokenizer = load_for_inference(model_path, tokenizer_path, device=device)
    reference, _ = load_for_inference(reference_path, tokenizer_path or str(model_path), device=device)
    check_reference(model, reference, tokenizer, reference_path)
    seq_length = seq_length or model.config.max_position_embeddings
    batches = [_on(b, model.device) for b in _pair_batches(source, tokenizer, objective, seq_length, batch_size,
                                                           max_batches)]
    return model, reference, batches


def evaluate_dpo(model_path, reference_path, source: DataSource, *, beta: float = 0.1, tokenizer_path: str | None = None,
                 seq_length: int | None = None, batch_size: int = 8, max_batches: int | None = None,
                 device: str = "auto") -> dict:
    """{"dpo_loss", "rewards_accuracy", "rewards_margin", "rewards_chosen", "rewards_rejected", "logps_chosen",
    "logps_rejected", "pairs"}: means over the pairs of TRL's sigmoid DPO loss and metrics."""
    from neox_hf.objectives.dpo import DPOObjective, attach_reference_logps, reference_logps

    model, reference, batches = _policy_reference_and_batches(model_path, reference_path, source, "dpo", tokenizer_path,
                                                              seq_length, batch_size, max_batches, device)
    table = reference_logps(reference, batches, num_pairs=1 + max(int(b["pair_index"].max()) for b in batches))
    del reference
    loss_sum, sums, pairs = _sums(DPOObjective(beta=beta), model,
                                  [attach_reference_logps(b, table) for b in batches])
    return {"model": str(model_path), "reference": str(reference_path), "data": source.path, "beta": beta,
            "dpo_loss": loss_sum / pairs, "rewards_accuracy": sums["rewards/accuracies"] / pairs,
            "rewards_margin": sums["rewards/margins"] / pairs, "rewards_chosen": sums["rewards/chosen"] / pairs,
            "rewards_rejected": sums["rewards/rejected"] / pairs, "logps_chosen": sums["logps/chosen"] / pairs,
            "logps_rejected": sums["logps/rejected"] / pairs, "pairs": pairs}


def evaluate_kto(model_path, reference_path, source: DataSource, *, beta: float = 0.1, desirable_weight: float = 1.0,
                 undesirable_weight: float = 1.0, tokenizer_path: str | None = None, seq_length: int | None = None,
                 batch_size: int = 8, max_batches: int | None = None, device: str = "auto") -> dict:
    """{"kto_loss", "kl", "rewards_chosen", "rewards_rejected", "rewards_margin", "logps_chosen", "logps_rejected",
    "examples"}: means over the examples of TRL's KTO loss and metrics (`neox_hf.objectives.kto`)."""
    from neox_hf.objectives.kto import KTOObjective

    model, reference, batches = _policy_reference_and_batches(model_path, reference_path, source, "kto", tokenizer_path,
                                                              seq_length, batch_size, max_batches, device)
    objective = KTOObjective(beta=beta, desirable_weight=desirable_weight, undesirable_weight=undesirable_weight,
                             reference_model=reference)
    loss_sum, sums, examples = _sums(objective, model, batches)
    return {"model": str(model_path), "reference": str(reference_path), "data": source.path, "beta": beta,
            "kto_loss": loss_sum / examples, "kl": sums["kl"] / examples,
            "rewards_chosen": sums["rewards/chosen"] / examples, "rewards_rejected": sums["rewards/rejected"] / examples,
            "rewards_margin": sums["rewards/margins"] / examples, "logps_chosen": sums["logps/chosen"] / examples,
            "logps_rejected": sums["logps/rejected"] / examples, "examples": examples}


def check_reference(model, reference, tokenizer, reference_path) -> None:
    """DPO and KTO score the same token ids under both models: a reference whose own tokenizer has another vocabulary than
    the one the pairs were tokenised with is refused; a reference of another architecture (a Llama reference for a
    GPTNeoX policy) is allowed, with a note, since the usual reference is the policy's own starting model."""
    from neox_hf.inference import folder_tokenizer

    own = folder_tokenizer(Path(reference_path))
    if own is not None and own.get_vocab() != tokenizer.get_vocab():
        ours, theirs = tokenizer.get_vocab(), own.get_vocab()
        differ = (set(ours) ^ set(theirs)) or {t for t in ours if ours[t] != theirs[t]}
        token = min(differ, key=lambda t: ours.get(t, theirs.get(t)))  # the lowest id that differs
        raise UsageError(f"the reference {reference_path} has another vocabulary ({len(theirs):,} tokens) than the "
                         f"policy's tokenizer ({len(ours):,}; {token!r} is {_token_id(theirs, token)} in the "
                         f"reference's, {_token_id(ours, token)} in the policy's): DPO compares the log-probabilities "
                         "of the same token ids under both; give the policy's starting model as --reference")
    architectures = [_architecture(m) for m in (model, reference)]
    if architectures[0] != architectures[1]:
        print_to_stderr(f"note: the reference {reference_path} is a {architectures[1]}, the policy a "
                        f"{architectures[0]}: DPO's rewards are then measured against another model than the policy's "
                        "starting point (same vocabulary, so the scores are defined)")


def _architecture(model) -> str:
    config = getattr(model, "config", None)
    names = getattr(config, "architectures", None) or [type(model).__name__]
    return f"{names[0]} ({getattr(config, 'model_type', '?')})"


def _token_id(vocab: dict, token: str) -> str:
    return f"id {vocab[token]}" if token in vocab else "absent"


def evaluate_reward_model(model_path, source: DataSource, *, tokenizer_path: str | None = None,
                          seq_length: int | None = None, batch_size: int = 8, max_batches: int | None = None,
                          device: str = "auto") -> dict:
    """{"rm_loss", "accuracy", "margin", "mean_reward", "pairs"}: means over the pairs."""
    from neox_hf.objectives.rm import RewardObjective

    model, tokenizer = load_reward_model(model_path, tokenizer_path, device=device)
    seq_length = seq_length or model.config.max_position_embeddings
    batches = [_on(b, model.device) for b in _pair_batches(source, tokenizer, "rm", seq_length, batch_size,
                                                           max_batches)]
    loss_sum, sums, pairs = _sums(RewardObjective(), model, batches)
    return {"model": str(model_path), "data": source.path, "rm_loss": loss_sum / pairs,
            "accuracy": sums["accuracy"] / pairs, "margin": sums["margin"] / pairs,
            "mean_reward": sums["mean_reward"] / pairs, "pairs": pairs}


def load_reward_model(model_path, tokenizer_path: str | None = None, *, device: str = "auto"):
    """(stock sequence-classification model with one label in eval mode, tokenizer) from a reward-model folder."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from neox_hf.errors import CheckpointError
    from neox_hf.inference import inference_device
    from neox_hf.data.tokenizer import load_tokenizer
    from neox_hf.model.folder import from_pretrained_whole

    folder = Path(model_path)
    if not (folder / "config.json").is_file():
        raise CheckpointError(f"reward model folder not found (no config.json): {folder}")
    config = AutoConfig.from_pretrained(folder)
    if not any(a.endswith("ForSequenceClassification") for a in config.architectures or []) or config.num_labels != 1:
        raise UsageError(f"{folder} is not a reward model (architectures {config.architectures}, {config.num_labels} "
                         "labels); give the folder a `train.objective: rm` run saved, or use --objective lm / dpo")
    tokenizer = load_tokenizer(tokenizer_path or str(folder))
    model = from_pretrained_whole(AutoModelForSequenceClassification, folder, dtype=torch.float32)
    if model.config.pad_token_id is None:  # transformers' pooling finds the last token by the pad id
        model.config.pad_token_id = tokenizer.pad_token_id
    return model.to(inference_device(device)).eval(), tokenizer
