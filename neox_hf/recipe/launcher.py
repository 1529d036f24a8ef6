"""The launcher's settings (`accelerate launch` with an accelerate config, or its flags) reconciled with the recipe.

Gap filled: `accelerate launch` puts an accelerate config's DeepSpeed keys (`zero_stage`, offload devices,
`gradient_accumulation_steps`, `gradient_clipping`, `deepspeed_config_file`) and `mixed_precision` into the
environment, and Accelerate's `DeepSpeedPlugin(hf_ds_config=...)` then refuses to start ("When using
`deepspeed_config_file`, the following accelerate config variables will be ignored"); with launcher flags instead of a
config file it silently lets the JSON win. Our DeepSpeed JSON is generated from the recipe, so neither is right:
here the launcher's values become one more layer of the recipe, under the recipe files and overrides. The launcher's
`dynamo_backend` (with which Accelerate would torch.compile the whole model in `prepare`, the fused loss included)
becomes `train.compile` the same way.

- The recipe leaves a key unset → the launcher's value is used.
- Both set it to the same value → fine.
- They differ → the run is refused in one line naming both values and how to make them agree.

Every line of the start-up report that this produces says which value came from where.

Values `accelerate config` writes for everyone who answers a question with Enter (`mixed_precision: 'no'`,
`gradient_accumulation_steps: 1`, offload devices `none`) are accelerate's defaults, not a choice: they defer to the
recipe (a recipe training fp16 with `mixed_precision: 'no'` in the user's default config is not a contradiction;
the report says the recipe decided). `zero_stage` has no such neutral value: every DeepSpeed accelerate config
names one, and it is compared.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from neox_hf.errors import RecipeError

# Where a launcher value comes from: `accelerate launch` lists the accelerate config's deepspeed_config keys here.
CONFIG_FIELDS = "ACCELERATE_CONFIG_DS_FIELDS"


@dataclass(frozen=True)
class LauncherSetting:
    accelerate_key: str  # as in an accelerate config file, e.g. zero_stage
    recipe_key: str  # dotted recipe path, e.g. parallel.zero_stage
    value: Any  # in the recipe's terms
    shown: str  # as the launcher wrote it
    neutral: bool  # accelerate's own default: the recipe decides
    from_config_file: bool


@dataclass(frozen=True)
class _Key:
    env: str
    accelerate_key: str
    recipe_key: str
    convert: Callable[[str], Any]
    neutral: tuple[str, ...] = ()


def _whole(key: str, least: int) -> Callable[[str], int]:
    """A converter for an integer key, refusing what `int()` would raise on (a word, `1.5`) in one line naming it."""
    def convert(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < least:
            raise RecipeError(f"the launch sets `{key}: {raw}`, which is not a whole number ≥ {least}; fix it in the "
                              f"accelerate config (or the `accelerate launch` flag), or remove it")
        return value
    return convert


def _offload(key: str, what: str):
    """The converter of an accelerate offload device (`key`) into whether `what` goes to CPU memory."""
    def offloads(raw: str) -> bool:
        if raw not in ("none", "cpu", "nvme"):
            raise RecipeError(f"the launch sets `{key}: {raw}`, which is not an offload device; use none or cpu in the "
                              "accelerate config (or remove the key)")
        if raw == "nvme":
            raise RecipeError(f"the accelerate config sets `{key}: nvme`: neox_hf offloads {what} to CPU memory only; "
                              "set it to cpu (or none) in the accelerate config")
        return raw == "cpu"

    return offloads


_offload_optimizer = _offload("offload_optimizer_device", "optimizer states")
_offload_param = _offload("offload_param_device", "parameters")


def _precision(raw: str) -> str:
    precision = {"no": "fp32", "bf16": "bf16", "fp16": "fp16", "fp8": "fp8"}.get(raw)
    if precision is None:
        raise RecipeError(f"the launch asks for `mixed_precision: {raw}`, which neox_hf does not train in; use no, "
                          "bf16, fp16 or fp8 in the accelerate config (or leave it to `train.precision`)")
    return precision


def _clipping(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise RecipeError(f"the accelerate config's `gradient_clipping: {raw}` is not a number; give one (0 disables "
                          "clipping) or remove the key") from None


def _fsdp_backend(raw: str) -> str:
    """An accelerate FSDP config (`distributed_type: FSDP`) asks for our FSDP2 engine."""
    return "fsdp2" if raw == "true" else "deepspeed"


def _fsdp_version(raw: str) -> str:
    if raw != "2":
        raise RecipeError(f"the accelerate config sets `fsdp_version: {raw}`: neox_hf shards with FSDP2 only "
                          "(`parallel.backend: fsdp2`); set `fsdp_version: 2` in the accelerate config")
    return "fsdp2"


def _dynamo(raw: str) -> bool:
    if raw not in ("no", "inductor"):
        raise RecipeError(f"the launch asks for `dynamo_backend: {raw.upper()}`: neox_hf compiles with torch.compile's "
                          "inductor (`train.compile: true`) only; set dynamo_backend to INDUCTOR or NO in the "
                          "accelerate config (or drop it and use `--train.compile true`)")
    return raw == "inductor"


_KEYS = (
    _Key("ACCELERATE_DEEPSPEED_ZERO_STAGE", "zero_stage", "parallel.zero_stage", _whole("zero_stage", 0)),
    _Key("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "offload_optimizer_device", "parallel.offload_optimizer",
         _offload_optimizer, neutral=("none",)),
    _Key("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "offload_param_device", "parallel.offload_params",
         _offload_param, neutral=("none",)),
    _Key("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "gradient_accumulation_steps", "train.gradient_accumulation_steps",
         _whole("gradient_accumulation_steps", 1), neutral=("1",)),
    _Key("ACCELERATE_GRADIENT_CLIPPING", "gradient_clipping", "train.clip_grad", _clipping),
    _Key("ACCELERATE_MIXED_PRECISION", "mixed_precision", "train.precision", _precision, neutral=("no",)),
    _Key("ACCELERATE_DEEPSPEED_CONFIG_FILE", "deepspeed_config_file", "parallel.deepspeed_config", str,
         neutral=("none",)),
    _Key("ACCELERATE_USE_FSDP", "use_fsdp", "parallel.backend", _fsdp_backend, neutral=("false",)),
    _Key("FSDP_VERSION", "fsdp_version", "parallel.backend", _fsdp_version),
    # accelerate would torch.compile the whole model in `prepare` (the fused loss included); it becomes train.compile
    _Key("ACCELERATE_DYNAMO_BACKEND", "dynamo_backend", "train.compile", _dynamo, neutral=("no",)),
)


# `distributed_type`s whose plugin Accelerate would build in place of ours (accelerate launch sets ACCELERATE_USE_…):
# each ended in a RuntimeError from inside Accelerate once the model was built. (FSDP is ours: `parallel.backend:
# fsdp2`, filled in from the config above.)
_FOREIGN_DISTRIBUTED_TYPES = (
    ("ACCELERATE_USE_MEGATRON_LM", "MEGATRON_LM",
     "split layers with `parallel.tensor_parallel` / `parallel.pipeline_parallel`"),
)


def check_distributed_type(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a launch whose accelerate config asks for a distributed type neox_hf's engines do not run on."""
    environ = os.environ if environ is None else environ
    for env, name, instead in _FOREIGN_DISTRIBUTED_TYPES:
        if environ.get(env, "").strip().lower() in ("1", "true", "yes", "y", "on"):
            raise RecipeError(f"the launch sets `distributed_type: {name}` ({env}), which neox_hf does not train "
                              f"with (its engines come from the recipe's `parallel` section: DeepSpeed or FSDP2): "
                              f"launch with a DeepSpeed accelerate config (`distributed_type: DEEPSPEED`, e.g. "
                              f"examples/launch/cpu_2proc_deepspeed.yaml) or plain `accelerate launch "
                              f"--use_deepspeed`, and {instead}")


def launcher_settings(environ: Mapping[str, str] | None = None) -> list[LauncherSetting]:
    """What the launch asked for, in recipe terms (nothing when the run was not started by `accelerate launch`)."""
    environ = os.environ if environ is None else environ
    check_distributed_type(environ)
    from_file = set(environ.get(CONFIG_FIELDS, "").split(","))
    settings = []
    for key in _KEYS:
        raw = environ.get(key.env)
        if raw is None or raw == "":
            continue
        raw = raw.strip().lower() if key.convert is not str else raw
        settings.append(LauncherSetting(key.accelerate_key, key.recipe_key, key.convert(raw), raw,
                                        neutral=raw in key.neutral, from_config_file=key.accelerate_key in from_file))
    return settings


def reconcile_with_launcher(raw: dict, source: str, environ: Mapping[str, str] | None = None) -> tuple[dict, list[str]]:
    """The raw recipe (files and overrides merged, not yet validated) with the launcher's values filled in where it
    leaves a key unset; and the start-up notes saying where each launcher value went. Raises RecipeError on a
    contradiction."""
    notices = []
    for setting in launcher_settings(environ):
        ours = _recipe_value(raw, setting.recipe_key)
        where = _launcher_name(setting)
        if setting.neutral:
            if setting.from_config_file and ours != setting.value:
                decides = f"`{setting.recipe_key}: {_show(ours)}`" if ours is not None else f"`{setting.recipe_key}`"
                notices.append(f"{where} `{setting.accelerate_key}: {setting.shown}` is accelerate's default; the "
                               f"recipe's {decides} decides")
            continue
        if ours is None or ours == "auto":  # `auto` (precision, compile) takes what the launch asks for
            raw = _with_value(raw, setting.recipe_key, setting.value)
            left = "leaves it unset" if ours is None else "leaves it to `auto`"
            notices.append(f"`{setting.recipe_key}: {_show(setting.value)}` comes from {where} "
                           f"(`{setting.accelerate_key}: {setting.shown}`; the recipe {left})")
        elif ours == setting.value:
            notices.append(f"{where} `{setting.accelerate_key}: {setting.shown}` agrees with the recipe's "
                           f"`{setting.recipe_key}`")
        else:
            raise _contradiction(setting, ours, source)
    return raw, notices


def launcher_precision(environ: Mapping[str, str] | None = None) -> str | None:
    """The precision `accelerate launch` asks for (its `mixed_precision`), or None where it leaves it to the recipe
    (unset, or accelerate's default `no`): what `train.precision: auto` takes first."""
    for setting in launcher_settings(environ):
        if setting.recipe_key == "train.precision" and not setting.neutral:
            return setting.value
    return None


def check_recipe_agrees_with_launcher(recipe, environ: Mapping[str, str] | None = None) -> None:
    """For a Recipe built in Python (not through `parse_run_args`): a launcher value that contradicts it is refused
    here rather than silently overridden by the generated DeepSpeed JSON. (`train.precision: auto` took the
    launcher's mixed precision when the recipe was settled: `launcher_precision`.) A DeepSpeed launch of an FSDP2
    recipe is refused too: Accelerate would set its processes up for DeepSpeed's engine."""
    environ = os.environ if environ is None else environ
    if recipe.parallel.backend == "fsdp2" and environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise RecipeError("`accelerate launch --use_deepspeed` (or a DeepSpeed accelerate config) with "
                          "`parallel.backend: fsdp2`: launch it with `torchrun --standalone --nproc_per_node N "
                          "run_clm_neox.py ...` or an FSDP accelerate config (examples/launch/cpu_2proc_fsdp2.yaml)")
    for setting in launcher_settings(environ):
        if setting.neutral:
            continue
        section, name = setting.recipe_key.split(".")
        ours = getattr(getattr(recipe, section), name)
        if ours != setting.value and ours != "auto":
            raise _contradiction(setting, ours, "the recipe")


@contextlib.contextmanager
def launcher_environment_reconciled(recipe):
    """While Accelerate builds its DeepSpeed plugin and Accelerator: the launcher's values have been folded into the
    recipe (or agree with it), so Accelerate must neither refuse the JSON for them nor read the launcher's
    accumulation steps over the recipe's (`Accelerator` prefers ACCELERATE_GRADIENT_ACCUMULATION_STEPS to its
    argument), nor compile the model its own way (the launcher's dynamo_backend is `train.compile` now). The
    environment is restored afterwards."""
    t = recipe.train
    replaced = {CONFIG_FIELDS: None, "ACCELERATE_GRADIENT_ACCUMULATION_STEPS": str(t.gradient_accumulation_steps),
                "ACCELERATE_DYNAMO_BACKEND": None}
    saved = {key: os.environ.get(key) for key in replaced}
    try:
        for key, value in replaced.items():
            _set_env(key, value)
        yield
    finally:
        for key, value in saved.items():
            _set_env(key, value)


def _set_env(key: str, value: str | None) -> None:
    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _launcher_name(setting: LauncherSetting) -> str:
    return "the accelerate config" if setting.from_config_file else "`accelerate launch`"


def _contradiction(setting: LauncherSetting, ours, source: str) -> RecipeError:
    where = _launcher_name(setting)
    return RecipeError(
        f"{where} sets `{setting.accelerate_key}: {setting.shown}` but {source} sets `{setting.recipe_key}: "
        f"{_show(ours)}`; make them agree: pass `--{setting.recipe_key} {_show(setting.value)}`, or change or remove "
        f"`{setting.accelerate_key}` in {where}"
    )


def _recipe_value(raw: dict, dotted: str):
    """The recipe's own value for a key, or None where it leaves the key unset (`train.precision: auto` included)."""
    node: Any = raw
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part, node.get(part.replace("_", "-")))
    if dotted == "train.precision" and node == "auto":
        return None
    return node


def _with_value(raw: dict, dotted: str, value) -> dict:
    section, name = dotted.split(".")
    merged = dict(raw)
    merged[section] = {**(raw.get(section) or {}), name: value}
    return merged


def _show(value) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)
