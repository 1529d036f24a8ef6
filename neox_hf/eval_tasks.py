"""lm-evaluation-harness tasks on the in-training model (GPT-NeoX's `eval_tasks`), and the model-card table.

`train.eval_tasks: [lambada_openai, ...]` runs lm-eval at each eval interval through its HF model interface
(`HFLM(pretrained=<our model object>)`), so scores come from the same code as `lm_eval --model hf` on the saved
folder. An entry may also be a task YAML file (`evals/my_task.yaml`): its folder is added to lm-eval's task search
path and its `task:` name is run, which is how a task defined from local files runs with nothing downloaded.
lm-eval is optional: `pip install -e ".[eval]"`.

Parallel layouts (lm-eval runs on one process; the others wait at a barrier):
- one process, DDP, ZeRO-1/2: every rank holds the full weights; the main process evaluates the unwrapped model
  itself (no copy).
- tensor parallelism and ZeRO-3: the full weights are gathered (the same collective as saving the final model) and
  the main process evaluates a plain GPTNeoX copy built from them. This costs one full fp32 copy of the model on the
  main process's device for the duration of the evaluation; on models that do not fit twice, leave eval_tasks empty
  and run `lm_eval` on the saved step folders instead. (Running our TP forward with gathered logits would avoid the
  copy but needs every rank inside lm-eval's loop, which its HF interface does not do.) Pipeline parallelism does
  not exist here (`parallel.pipeline_parallel` must be 1).
Other ranks wait in a barrier while the main process evaluates: keep the tasks small (or lm-eval's `limit`) next
to the process group timeout (NCCL's default is 10 minutes).
"""

from __future__ import annotations

import contextlib
import logging
import random
from pathlib import Path

import numpy as np
import torch
import yaml

from neox_hf.errors import RecipeError

# lm-eval's per-metric keys look like "acc,none" (metric,filter); "alias" and stderr entries are not scores.
_NOT_SCORES = ("alias", "samples", "sample_len", "sample_count")


def run_eval_tasks(model, tokenizer, tasks: list[str], *, batch_size: int = 8, limit: int | float | None = None,
                   max_length: int | None = None) -> dict[str, float]:
    """`{"task/metric": score}` from lm-eval's `simple_evaluate` on `model` (a transformers causal LM object).

    The model is put in eval mode for the run and restored to its previous mode afterwards; nothing is downloaded
    for tasks given as local YAML files whose datasets are local.
    """
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    names, include_paths = resolve_tasks(tasks)
    # Indexing lm-eval's thousands of bundled task files takes seconds: skipped when every task is a local file.
    all_local = all(task.endswith((".yaml", ".yml")) for task in tasks)
    manager = TaskManager(include_path=include_paths or None, include_defaults=not all_local)
    was_training = model.training
    model.eval()
    try:
        with _quiet_lm_eval(), _rng_state_kept():
            lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length)
            # No global reseeding (its defaults would reset torch/numpy/random mid-training); few-shot sampling keeps
            # lm-eval's own fixed seed, so scores are comparable across steps and with `lm_eval` on a saved folder.
            results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                              log_samples=False, bootstrap_iters=0, random_seed=None,
                                              numpy_random_seed=None, torch_random_seed=None)
    finally:
        model.train(was_training)
    return scores_from_results(results["results"])


def resolve_tasks(tasks: list[str]) -> tuple[list[str], list[str]]:
    """Task names for lm-eval, and the folders of the entries given as YAML files."""
    names, folders = [], []
    for task in tasks:
        if not task.endswith((".yaml", ".yml")):
            names.append(task)
            continue
        path = Path(task)
        if not path.is_file():
            raise RecipeError(f"`train.eval_tasks` entry {task!r} is not a file; give an lm-eval task name or a task YAML path")
        config = yaml.safe_load(path.read_text()) or {}
        if not isinstance(config, dict) or not config.get("task"):
            raise RecipeError(f"{path}: an lm-eval task YAML needs a `task:` name")
        names.append(str(config["task"]))
        folders.append(str(path.resolve().parent))
    return names, list(dict.fromkeys(folders))


def scores_from_results(results: dict) -> dict[str, float]:
    """lm-eval's `results` section → flat `task/metric` floats (filter suffix ",none" dropped, stderr left out)."""
    scores = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            metric, _, filter_name = key.partition(",")
            if metric in _NOT_SCORES or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            suffix = "" if filter_name in ("", "none") else f"[{filter_name}]"
            scores[f"{task}/{metric}{suffix}"] = float(value)
    return scores


@contextlib.contextmanager
def _rng_state_kept():
    """Training randomness (dropout, sampling) continues after an evaluation as if it had not happened."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


class _quiet_lm_eval:
    """lm-eval warns on every call about the model object it is handed; in a training log that is noise."""

    def __enter__(self):
        self._logger = logging.getLogger("lm_eval")
        self._level = self._logger.level
        self._logger.setLevel(logging.ERROR)

    def __exit__(self, *exc):
        self._logger.setLevel(self._level)


def eval_tasks_in_training(accelerator, model, tokenizer, tasks: list[str], *, engine=None, batch_size: int = 8,
                           max_length: int | None = None) -> dict[str, float]:
    """Scores on the main process (`{}` on the others), whatever the layout; every rank must call it.

    See the module docstring for how tensor parallelism and ZeRO-3 are handled (a gathered plain copy).
    """
    unwrapped = accelerator.unwrap_model(model)
    full = _full_weights_copy(accelerator, unwrapped, engine)
    scores: dict[str, float] = {}
    if accelerator.is_main_process:
        target = full if full is not None else _plain_causal_lm(unwrapped)
        scores = run_eval_tasks(target, tokenizer, tasks, batch_size=batch_size, max_length=max_length)
    del full
    accelerator.wait_for_everyone()
    return scores


def _full_weights_copy(accelerator, unwrapped, engine):
    """A plain GPTNeoX holding the gathered weights on the main process, or None where the weights are whole."""
    zero3 = getattr(accelerator.state.deepspeed_plugin, "zero_stage", 0) == 3
    layout = engine.layout if engine is not None else None
    if (layout is None or (layout.tp == 1 and layout.pp == 1)) and not zero3:  # pipeline stages: merged too
        return None
    state_dict = engine.full_state_dict()  # collective: TP shards merged, ZeRO-3 gathered, pipeline stages merged
    if not accelerator.is_main_process:
        return None
    from neox_hf.model.spec import model_class_for_config
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is overwritten by the gathered ones
        config = _plain_causal_lm(unwrapped).config
        copy = model_class_for_config(config)(config)
    copy.tie_weights()
    # In the weights' dtype (bf16 under DeepSpeed bf16): scored as the saved folder and the unsharded model are.
    copy.to(next(iter(state_dict.values())).dtype).load_state_dict(state_dict)
    return copy.to(accelerator.device)


def _plain_causal_lm(unwrapped):
    """The transformers model inside a PEFT wrapper (its LoRA layers stay active in the base model's modules)."""
    return unwrapped.get_base_model() if hasattr(unwrapped, "get_base_model") else unwrapped


def eval_tasks_card_section(scores_by_step: list[tuple[int, dict[str, float]]]) -> str:
    """Markdown for the model card: the last step's lm-eval scores as a table (empty when there are none)."""
    if not scores_by_step:
        return ""
    step, scores = scores_by_step[-1]
    rows = "\n".join(f"| {key.split('/', 1)[0]} | {key.split('/', 1)[1]} | {value:.4f} |" for key, value in sorted(scores.items()))
    return (f"## lm-evaluation-harness (step {step})\n\n"
            "| task | metric | score |\n| --- | --- | --- |\n" + rows + "\n")
