"""Expert parallelism (`parallel.expert_parallel`, neox_hf/parallel/expert_parallel.py) against one process, through
`run_clm_neox.py`'s entry point under torchrun (gloo, fp32, dropout 0, GPT-NeoX-order data: every layout reads the
same global batches), on a tiny Mixtral (recipes/tiny-mixtral.yaml shrunk: 2 layers, hidden 64, 8 experts, top-2,
router loss on) with micro-batches of one sequence everywhere, so that the router loss, taken per micro-batch, sees
the same tokens on every layout:

- every run starts from a stock Mixtral folder (`model.from_pretrained`);
- EP2 (4 data-parallel ranks: 2 expert groups, each expert held by 2 ranks), EP4, EP2 × ZeRO-2, EP2 × FSDP2,
  GPT-NeoX's layout (the experts split over the tensor-parallel group, TP2 × 2 data-parallel) and TP2 attention ×
  EP2 over FSDP2 (the experts split over the 2 data-parallel ranks of each TP rank) train the same 6 steps as one
  process: losses within 1e-5, final weights within 1e-4, and the first step's gradients as the optimizer sees
  them (after DeepSpeed's or FSDP2's reduction) equal to one process's: the experts' within 1e-6 (DeepSpeed #5618's
  bug, experts averaged over the wrong ranks, is a factor of ep here);
- EP2's layout-free checkpoint (step 3, whole experts under transformers names) resumes on one process, on EP4 and on
  TP2 × EP2 over FSDP2, and EP2 × FSDP2's on one process, each continuing as the uninterrupted run; `neox_hf export` of an EP2 step
  folder writes the stock Mixtral folder of one process's step;
- the recipe refuses what expert parallelism does not run, each in one line.

All multi-process runs share one 4-process launch (tests/workers/expert_parallel_layouts.py: init_layouts.py writing
every run's first-step gradients); the one-process runs train meanwhile in the test process."""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, launch_env, train_in_this_process
from tests.test_resume import step_losses
from tests.test_resume_any_layout import pack_data  # noqa: F401 (fixture)

MIXTRAL = [str(REPO / "recipes" / "tiny-mixtral.yaml"), "--model.hidden_size", "64", "--model.intermediate_size",
           "64", "--model.num_layers", "2", "--model.seq_length", "64", "--model.vocab_size", "50432",
           "--train.micro_batch_size", "1", "--train.train_iters", "6", "--train.save_interval", "3",
           "--train.eval_iters", "0", "--train.log_interval", "1", "--output.tensorboard", "false",
           "--train.precision", "fp32", "--model.hidden_dropout", "0", "--model.attention_dropout", "0"]
STEP3 = Path("checkpoints") / "step_00000003"
EP2 = "--parallel.expert_parallel 2"
# name → overrides of each 4-process run (global batch 4: micro-batches of 1, accumulated where TP halves dp)
LAYOUTS = {
    "ep2": EP2,
    "ep4": "--parallel.expert_parallel 4",
    "ep2_zero2": f"{EP2} --parallel.zero_stage 2",
    "ep2_fsdp2": f"{EP2} --parallel.backend fsdp2",
    "neox_tp2": f"{EP2} --parallel.experts_over tensor --parallel.tensor_parallel 2 "
                "--train.gradient_accumulation_steps 2",
    "tp2_ep2_fsdp2": f"{EP2} --parallel.tensor_parallel 2 --parallel.backend fsdp2 --train.gradient_accumulation_steps 2",
}
TENSOR_PARALLEL = ("neox_tp2", "tp2_ep2_fsdp2")


def _stock_mixtral(folder: Path) -> Path:
    """A stock `MixtralForCausalLM` folder of MIXTRAL's shape (the router loss on, as the recipe has it)."""
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=50432, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                           max_position_embeddings=64, tie_word_embeddings=False, output_router_logits=True,
                           router_aux_loss_coef=0.02)
    MixtralForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pack_data) -> Path:  # noqa: F811
    root = tmp_path_factory.mktemp("expert_parallel")
    # every run starts from a stock Mixtral folder: a transformers user's checkpoint round-trips through each layout
    common = [*MIXTRAL, *pack_data, "--model.from_pretrained", str(_stock_mixtral(root / "stock"))]
    resume = lambda source: f"--train.resume {root / source / STEP3}"  # noqa: E731
    layouts = {**LAYOUTS,  # then EP2's checkpoint resumed on EP4 and on TP2 × EP2 over FSDP2
               "ep4_from_ep2": f"--parallel.expert_parallel 4 {resume('ep2')}",
               "tp2_ep2_fsdp2_from_ep2": f"{LAYOUTS['tp2_ep2_fsdp2']} {resume('ep2')}"}
    launch = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
         str(REPO / "tests" / "workers" / "expert_parallel_layouts.py"), str(root),
         *[f"{name}={overrides}" for name, overrides in layouts.items()], "--", *common],
        cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def in_process(name, *extra):
        train_in_this_process([*common, *extra, "--output.dir", str(root / name)])

    with _first_gradients_recorded(root / "one.grads.pt"):
        in_process("one", "--train.gradient_accumulation_steps", "4")
    output, _ = launch.communicate(timeout=900)
    assert launch.returncode == 0, f"the expert-parallel launch failed:\n{output[-5000:]}"
    for source in ("ep2", "ep2_fsdp2"):
        in_process(f"one_from_{source}", "--train.gradient_accumulation_steps", "4", *shlex.split(resume(source)))
    return root


@contextlib.contextmanager
def _first_gradients_recorded(path: Path):
    """The worker's probe (its first-step gradients), around a one-process run in this process."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    import neox_hf.engines.fsdp2 as fsdp2
    import neox_hf.engines.replica as replica

    sys.path.insert(0, str(REPO / "tests" / "workers"))
    try:
        import expert_parallel_layouts as worker
    finally:
        sys.path.pop(0)
    saved = {cls: cls.clip_gradients for cls in (fsdp2.FSDP2Engine, replica.ReplicaEngine)}
    deepspeed_step = DeepSpeedEngine.step
    worker._record_first_gradients(lambda: path)
    try:
        yield
    finally:
        for cls, clip in saved.items():
            cls.clip_gradients = clip
        DeepSpeedEngine.step = deepspeed_step


def _worst_weight(want: Path, got: Path, skip: tuple[str, ...] = ()) -> float:
    from safetensors.torch import load_file

    a, b = load_file(want / "model.safetensors"), load_file(got / "model.safetensors")
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a if k not in skip)


def _worst_loss(want: Path, got: Path, steps) -> float:
    reference, losses = step_losses(want), step_losses(got)
    assert sorted(losses) == list(steps), losses
    return max(abs(losses[s] - reference[s]) for s in steps)


# The vocabulary-parallel embedding under TP2 ends 3.2e-3 from one process with or without experts (a TP2 run of the
# same Mixtral without expert parallelism measured the same number: rows whose Adam steps are rounding-sensitive);
# its first-step gradient equals one process's like every other tensor's (asserted below).
TP_EMBEDDING = ("model.embed_tokens.weight",)


@pytest.mark.distributed
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_expert_parallel_layout_trains_as_one_process(runs, layout):
    import torch

    skip = TP_EMBEDDING if layout in TENSOR_PARALLEL else ()
    assert _worst_loss(runs / "one", runs / layout, range(1, 7)) <= 1e-5
    assert _worst_weight(runs / "one", runs / layout, skip) <= 1e-4
    want, got = torch.load(runs / "one.grads.pt"), torch.load(runs / f"{layout}.grads.pt")
    assert want.keys() == got.keys()
    experts = [k for k in want if ".experts." in k]
    assert len(experts) == 4, experts  # gate_up_proj and down_proj of 2 layers, whole (8 experts each)
    assert all(got[k].shape[0] == 8 for k in experts)
    assert max((want[k] - got[k]).abs().max().item() for k in experts) <= 1e-6
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-6


@pytest.mark.distributed
def test_expert_parallel_start_up_says_how_experts_are_split(runs):
    printed = (runs / "ep2.stdout").read_text()
    assert "expert parallel 2: 8 experts per MoE layer split over 2 data-parallel ranks, 4 per rank" in printed
    assert "expert parallel 2: 8 experts per MoE layer split over the tensor-parallel group (GPT-NeoX's layout)" \
        in (runs / "neox_tp2.stdout").read_text()


@pytest.mark.distributed
@pytest.mark.parametrize("resumed, source", [("ep4_from_ep2", "ep2"), ("tp2_ep2_fsdp2_from_ep2", "ep2"),
                                             ("one_from_ep2", "ep2"), ("one_from_ep2_fsdp2", "ep2_fsdp2")])
def test_an_expert_parallel_checkpoint_resumes_on_another_layout(runs, resumed, source):
    assert _worst_loss(runs / source, runs / resumed, range(4, 7)) <= 1e-5
    assert _worst_weight(runs / source, runs / resumed) <= 1e-4


@pytest.mark.distributed
def test_export_writes_the_stock_folder_from_an_expert_parallel_step(runs, tmp_path, capsys):
    import torch
    from transformers import MixtralForCausalLM

    from neox_hf.cli import main

    assert main(["export", str(runs / "ep2" / STEP3), str(tmp_path / "hf")]) == 0, capsys.readouterr().err
    assert main(["export", str(runs / "one" / STEP3), str(tmp_path / "one")]) == 0, capsys.readouterr().err
    one = MixtralForCausalLM.from_pretrained(tmp_path / "one", dtype=torch.float32).eval()
    ep2 = MixtralForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    want, got = one.state_dict(), ep2.state_dict()
    assert want.keys() == got.keys()
    assert max((want[k] - got[k]).abs().max().item() for k in want) <= 1e-4
    ids = torch.randint(0, 50000, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (one(ids).logits - ep2(ids).logits).abs().max().item() <= 1e-4


# ----------------------------------------------------------------------------------------------------------------
# Fast tier: the recipe's refusals and the expert groups
# ----------------------------------------------------------------------------------------------------------------

def _recipe(**parallel):
    from neox_hf.recipe import load_yaml_file, recipe_from_dict

    data = load_yaml_file(REPO / "recipes" / "tiny-mixtral.yaml")
    data.setdefault("parallel", {}).update(parallel)
    return recipe_from_dict(data)


@pytest.mark.parametrize("parallel, names", [
    ({"zero_stage": 3}, "`parallel.zero_stage: 3`"),
    ({"pipeline_parallel": 2}, "`parallel.pipeline_parallel` > 1"),
    ({"tensor_parallel": 2}, "set `parallel.experts_over: tensor`"),
    ({"tensor_parallel": 2, "experts_over": "data"}, "or `parallel.backend: fsdp2`"),
    ({"experts_over": "tensor"}, "set tensor_parallel: 2, or experts_over: data"),
    ({"expert_parallel": 0}, "`parallel.expert_parallel` must be ≥ 1"),
])
def test_expert_parallel_refuses_what_it_does_not_run_in_one_line(parallel, names):
    from neox_hf.errors import RecipeError

    with pytest.raises(RecipeError) as refused:
        _recipe(**{"expert_parallel": 2, **parallel})
    assert names in str(refused.value) and "\n" not in str(refused.value)


def test_a_model_without_experts_is_refused_by_name():
    from types import SimpleNamespace

    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from neox_hf.errors import RecipeError
    from neox_hf.parallel.expert_parallel import apply_expert_parallel

    model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, vocab_size=64))
    with pytest.raises(RecipeError, match=r"needs a model with experts .* set expert_parallel: 1"):
        apply_expert_parallel(model, SimpleNamespace(ep=2))


def test_expert_groups_are_consecutive_ranks_and_their_replicas_strided():
    """DeepSpeed's MoE order: with 8 data-parallel ranks and EP2, experts split over (0, 1), (2, 3), …, each block held
    by the ranks 0, 2, 4, 6 or 1, 3, 5, 7; with TP2 and CP2 the groups run along each dp × cp group of one TP rank."""
    from neox_hf.parallel.layout import edp_group_ranks, ep_group_ranks

    assert ep_group_ranks(1, 8, 1, 1, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert edp_group_ranks(1, 8, 1, 1, 2) == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ep_group_ranks(1, 2, 2, 2, 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert edp_group_ranks(1, 2, 2, 2, 4) == [[0], [2], [4], [6], [1], [3], [5], [7]]


def test_a_launch_without_enough_data_parallel_ranks_for_the_experts_is_refused_with_the_command(monkeypatch):
    from neox_hf.errors import LaunchError
    from neox_hf.parallel.layout import check_launch as launch_check  # named so the tiers keep it fast

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(LaunchError, match=r"over 2 data-parallel ranks, but this launch has 1; launch with: "
                                          r"accelerate launch --use_deepspeed --num_processes 2 "):
        launch_check(_recipe(expert_parallel=2), "recipe.yaml")
    monkeypatch.setenv("WORLD_SIZE", "6")
    with pytest.raises(LaunchError, match=r"over 4 data-parallel ranks, but this launch has 6"):
        launch_check(_recipe(expert_parallel=4), "recipe.yaml")
