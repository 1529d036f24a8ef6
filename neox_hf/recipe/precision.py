"""`train.precision: auto` settled once, while the recipe is built and before it is validated: nothing writes the
precision into a recipe after that (the Accelerator, the report, checkpoints and `recipe.yaml` read what was settled).

`auto` takes the precision `accelerate launch` asks for (`--mixed_precision`, or its config file's); else it resumes
in the precision its checkpoint was trained in (a DeepSpeed bf16 checkpoint holds bf16 weights an fp32
engine cannot load); otherwise it is this device's choice (`resolve_precision`: bf16 where it
trains faster than fp32 on this device, fp32 elsewhere).
"""

from __future__ import annotations

from neox_hf.hardware import Bf16Verdict, bf16_verdict


def settle_precision(recipe) -> list[str]:
    """Replace `auto` in `recipe.train.precision` by what it stands for here; return the start-up notices saying so.
    Call before `validate` (`recipe_from_dict` does)."""
    t = recipe.train
    if t.precision != "auto":
        return []
    notices: list[str] = []
    from neox_hf.recipe.launcher import launcher_precision

    launched = launcher_precision()
    if launched is not None:  # `accelerate launch --mixed_precision` (or its config file) asks for one
        t.precision = launched
        return [f"`train.precision: auto` takes {launched} from `accelerate launch` (its mixed_precision)"]
    resumed = _resumed_precision(recipe, notices)
    if resumed is not None:
        t.precision, checkpoint = resumed
        return [*notices, f"`train.precision: auto` resumes in {t.precision}, the precision {checkpoint} was "
                          "trained in"]
    verdict = bf16_verdict()
    t.precision = resolve_precision(t, verdict=verdict)
    return [*notices, f"`train.precision: auto` chose {t.precision} on this device ({verdict.why}); set "
                      "`train.precision: fp32` for the same numbers on every machine"]


def _resumed_precision(recipe, notices: list[str]) -> tuple[str, str] | None:
    """(precision, checkpoint folder name) of the checkpoint this run resumes, where it recorded one."""
    if recipe.train.resume is None:
        return None
    from neox_hf.checkpoint import checkpoint_precision, find_resume_checkpoint

    try:
        folder = find_resume_checkpoint(recipe.train.resume, recipe.output.dir, notify=notices.append)
    except Exception:  # noqa: BLE001 — a bad resume path is reported, with its fix, when the run checks it
        return None
    trained_in = checkpoint_precision(folder) if folder is not None else None
    return (trained_in, folder.name) if trained_in is not None else None


def resolve_precision(train, *, verdict: Bf16Verdict | None = None) -> str:
    """The precision `auto` stands for here: bf16 where it trains faster than fp32 (`bf16_verdict`), fp32 elsewhere.
    Other values are returned as given."""
    if train.precision != "auto":
        return train.precision
    if verdict is None:
        verdict = bf16_verdict()
    return "bf16" if verdict.faster else "fp32"
