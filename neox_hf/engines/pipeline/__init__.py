"""Pipeline parallelism: the GPTNeoX model's layers split over stages (GPT-NeoX `pipe_parallel_size`).

Engine: DeepSpeed's `PipelineEngine` (its 1F1B `TrainSchedule`), reached through `accelerator.prepare` of a
`deepspeed.pipe.PipelineModule`, as GPT-NeoX itself trains. Chosen over `torch.distributed.pipelining` (1F1B,
interleaved, zero-bubble schedules) because the DeepSpeed engine is the one shown to compose with everything else
here: ZeRO-1 over each stage's data-parallel group, our injected tensor-parallel layers (its pipe × data × model grid
is the layout's rank order and serves as DeepSpeed's mpu), gradient clipping over the whole model (the grid's
model-parallel group spans pipe × model), bf16/fp16 with loss scaling, tied weights across stages, per-stage
checkpoints through `accelerator.save_state`. torch's pipelining would need FSDP/DTensor for the ZeRO part and its
own optimizer-state sharding and clipping across stages; we have not shown it composes with ZeRO-1 and our TP.

The package, one module per job: `stages` (the layers and this rank's materialised stage), `partition` (layer list,
stage boundaries, report), `loss` (the last stage's loss), `schedule` (one train or eval step of the 1F1B schedule),
`merge` (stages × TP shards → one stock state dict / HF folder), `checkpoint_files` (DeepSpeed's per-layer files),
`engine` (the engine over all of them).
`engine.PipelineEngine` is what the loop talks to (registered in `neox_hf.engines`).
"""

from neox_hf.engines.pipeline.checkpoint_files import is_pipeline_checkpoint, pipeline_checkpoint_state_dict
from neox_hf.engines.pipeline.loss import StageLoss, head_loss
from neox_hf.engines.pipeline.merge import gather_pipeline_state_dict, save_pipeline_hf_folder, stage_hf_state_dict
from neox_hf.engines.pipeline.partition import (bubble_fraction, full_parameter_count, layer_parameter_counts,
                                                partition_stages, pipeline_layer_infos, pipeline_report, stage_report)
from neox_hf.engines.pipeline.schedule import (pipe_micro_batch, pipeline_eval_loss, pipeline_eval_loss_sums,
                                               pipeline_train_step)
from neox_hf.engines.pipeline.stages import (StageBuilder, build_pipeline_model, build_pipeline_module,
                                             is_pipeline_module, tied_head)

__all__ = ["StageBuilder", "StageLoss", "bubble_fraction", "build_pipeline_model", "build_pipeline_module",
           "full_parameter_count", "gather_pipeline_state_dict", "head_loss", "is_pipeline_checkpoint",
           "is_pipeline_module", "layer_parameter_counts", "partition_stages", "pipe_micro_batch",
           "pipeline_checkpoint_state_dict", "pipeline_eval_loss", "pipeline_eval_loss_sums", "pipeline_layer_infos",
           "pipeline_report", "pipeline_train_step", "save_pipeline_hf_folder", "stage_hf_state_dict", "stage_report",
           "tied_head"]
