"""Sequence-length curriculum, as GPT-NeoX runs it through DeepSpeed: step s (0-based) trains on the first
L(s) = CurriculumScheduler.update_difficulty(s + 1) positions of every sample (`global_steps + 1`, as DeepSpeed's
engine asks before each forward). The schedule itself is DeepSpeed's `CurriculumScheduler`; we only feed it the
step and cut the batches, which the loaders do since they know how many micro-batches they have given.
"""

from __future__ import annotations

from typing import Optional

from neox_hf.recipe import CurriculumConfig


class SeqlenCurriculum:
    """The current curriculum length for a step (DeepSpeed's scheduler, config translated from ours)."""

    def __init__(self, cfg: CurriculumConfig):
        from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

        schedule = ({"difficulty": list(cfg.difficulty), "max_step": list(cfg.max_step)}
                    if cfg.schedule_type == "fixed_discrete" else
                    {"total_curriculum_step": cfg.total_curriculum_step, "difficulty_step": cfg.difficulty_step,
                     "root_degree": cfg.root_degree})
        self._config = {"curriculum_type": "seqlen", "min_difficulty": cfg.min_difficulty,
                        "max_difficulty": cfg.max_difficulty, "schedule_type": cfg.schedule_type,
                        "schedule_config": schedule}
        self._scheduler = CurriculumScheduler(self._config)
        self._last_step: Optional[int] = None

    def seq_length_at(self, step: int) -> int:
        if self._last_step is not None and step < self._last_step:  # rewound (resume): replay from a fresh one
            from deepspeed.runtime.data_pipeline.curriculum_scheduler import CurriculumScheduler

            self._scheduler = CurriculumScheduler(self._config)
        self._last_step = step
        return int(self._scheduler.update_difficulty(step + 1))


class CurriculumLoader:
    """Any loader's batches cut to the curriculum length of their step (for `data.order: stream`)."""

    def __init__(self, loader, curriculum: SeqlenCurriculum, gradient_accumulation_steps: int, start_step: int = 0):
        self.loader, self.curriculum, self.accumulation = loader, curriculum, gradient_accumulation_steps
        self.micro_batches = start_step * gradient_accumulation_steps
        self.curriculum_seq_length: Optional[int] = None

    @property
    def stats(self) -> dict:
        return self.loader.stats

    def __iter__(self) -> "CurriculumLoader":
        return self

    def __next__(self) -> dict:
        from neox_hf.data.neox_order import truncate_batch

        batch = next(self.loader)
        self.curriculum_seq_length = self.curriculum.seq_length_at(self.micro_batches // self.accumulation)
        self.micro_batches += 1
        return truncate_batch(batch, self.curriculum_seq_length)

    def state_dict(self) -> dict:
        return {"curriculum_micro_batches": self.micro_batches, "loader": self.loader.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state["loader"])
        self.micro_batches = int(state["curriculum_micro_batches"])

    def load_resized_states(self, states: list[dict]) -> None:
        """Every old data-parallel rank's state (see `DataLoader.load_resized_states`); the curriculum goes on from
        the same step, counted in this run's micro-batches (the global batch is the same, the accumulation may not)."""
        self.loader.load_resized_states([state["loader"] for state in states])
        old = states[0]["loader"]["fingerprint"]
        global_batch = self.loader.batch_size * self.loader.dp_size * self.accumulation
        old_accumulation = max(global_batch // (old["micro_batch_size"] * old["dp_size"]), 1)
        self.micro_batches = int(states[0]["curriculum_micro_batches"]) // old_accumulation * self.accumulation

    def describe_position(self) -> str:
        return self.loader.describe_position()
