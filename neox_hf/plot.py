"""A picture of a run: `OUT/run.png` from `OUT/train_log.jsonl` (`neox_hf plot OUT`, and at the end of training).

Panels against the optimizer step: train loss (and held-out eval loss), learning rate, tokens per second, and the
lm-evaluation-harness scores when the run had `train.eval_tasks`. Drawn with matplotlib's Agg backend (no display),
written to a temporary file and renamed, so a reader never sees half a PNG. `model_card_section` is the markdown
the model card shows for it (the picture and the last lm-eval scores).
"""

from __future__ import annotations

from pathlib import Path

from neox_hf.eval_tasks import eval_tasks_card_section
from neox_hf.io import atomic_path
from neox_hf.checkpoint.run_log import LOG_NAME, PLOT_NAME, RunLog, read_run_log



def write_run_plot(output_dir) -> Path:
    """Draw `OUT/run.png` from the run's log; return its path.

    A `Figure` drawn by the Agg canvas, not pyplot: pyplot's `matplotlib.use("Agg")` would switch the backend of the
    whole process (a notebook calling `train` would lose its inline plots) and keeps every figure in a global
    registry; the figure alone also skips pyplot's import (~0.2 s of every run's end)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    output_dir = Path(output_dir)
    log = read_run_log(output_dir)
    task_keys = sorted({k for e in log.evals for k in e if k not in ("step", "loss", "perplexity")})
    panels = 4 if task_keys else 3
    figure = Figure(figsize=(8, 2.6 * panels), layout="constrained")
    FigureCanvasAgg(figure)  # attaches itself as figure.canvas
    axes = figure.subplots(panels, 1, sharex=True)
    _loss_panel(axes[0], log)
    _lr_panel(axes[1], log)
    _throughput_panel(axes[2], log)
    if task_keys:
        _tasks_panel(axes[3], log, task_keys)
    axes[-1].set_xlabel("step")
    figure.suptitle(f"{output_dir.resolve().name}: {len(log.steps)} steps")
    path = output_dir / PLOT_NAME
    with atomic_path(path) as temporary:
        figure.savefig(temporary, dpi=100, format="png")  # the temporary name does not end in .png
    return path


def _loss_panel(ax, log: RunLog) -> None:
    ax.plot([r["step"] for r in log.steps], [r["loss"] for r in log.steps], lw=1, label="train loss")
    evals = [e for e in log.evals if "loss" in e]
    if evals:
        ax.plot([e["step"] for e in evals], [e["loss"] for e in evals], "o-", lw=1.5, label="eval loss")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")


def _lr_panel(ax, log: RunLog) -> None:
    ax.plot([r["step"] for r in log.steps], [r["lr"] for r in log.steps], lw=1, color="tab:green")
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 2))
    ax.grid(alpha=0.3)


def tokens_per_second(log: RunLog) -> list[tuple[int, float]]:
    """(step, tokens/s): the loop's own `tokens_per_s` where step lines carry it (one per log window), else from
    consecutive steps' `time`, leaving out gaps (a resume, a log without `time`) and the step after an evaluation,
    whose wall time includes it."""
    windows = [(r["step"], r["tokens_per_s"]) for r in log.steps if "tokens_per_s" in r]
    if windows:
        return windows
    evaluated = {e["step"] for e in log.evals}
    rates = []
    for previous, current in zip(log.steps, log.steps[1:]):
        if current["step"] != previous["step"] + 1 or "time" not in current or "time" not in previous:
            continue
        if previous["step"] in evaluated:
            continue
        seconds = current["time"] - previous["time"]
        if seconds > 0:
            rates.append((current["step"], (current["consumed_tokens"] - previous["consumed_tokens"]) / seconds))
    return rates


def _throughput_panel(ax, log: RunLog) -> None:
    rates = tokens_per_second(log)
    if rates:
        steps, values = zip(*rates)
        ax.plot(steps, values, lw=0.8, alpha=0.4, color="tab:purple")
        window = max(1, len(values) // 20)
        smooth = [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
                  for i in range(len(values))]
        ax.plot(steps, smooth, lw=1.5, color="tab:purple", label=f"mean of {window} steps")
        ax.legend(loc="lower right")
    else:
        ax.text(0.5, 0.5, "no timing in train_log.jsonl", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("tokens / s")
    ax.grid(alpha=0.3)


def _tasks_panel(ax, log: RunLog, keys: list[str]) -> None:
    """Scores in [0, 1] (accuracies) on the left axis; unbounded ones (perplexities) on a log-scale right axis."""
    series = {key: [(e["step"], e[key]) for e in log.evals if key in e] for key in keys}
    bounded = [k for k in keys if all(0.0 <= v <= 1.0 for _, v in series[k])]
    unbounded = [k for k in keys if k not in bounded]
    for key in bounded:
        ax.plot(*zip(*series[key]), "o-", lw=1.5, label=key)
    ax.set_ylabel("lm-eval score")
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if unbounded:
        right = ax.twinx()
        for key in unbounded:
            right.plot(*zip(*series[key]), "s--", lw=1.2, label=key, color=f"C{len(bounded) + unbounded.index(key)}")
        right.set_yscale("log")
        right.set_ylabel("lm-eval (log scale)")
        more_handles, more_labels = right.get_legend_handles_labels()
        handles, labels = handles + more_handles, labels + more_labels
    ax.legend(handles, labels, loc="best", fontsize="small")


def last_task_scores(log: RunLog) -> list[tuple[int, dict[str, float]]]:
    """`[(step, {task/metric: score})]` of the last evaluation that ran lm-eval tasks (empty without any)."""
    for entry in reversed(log.evals):
        scores = {k: v for k, v in entry.items() if k not in ("step", "loss", "perplexity")}
        if scores:
            return [(entry["step"], scores)]
    return []


def model_card_section(output_dir) -> str:
    """Markdown for the model card: the run picture (when drawn) and the last lm-eval scores (when any)."""
    output_dir = Path(output_dir)
    parts = []
    if (output_dir / PLOT_NAME).is_file():
        parts.append(f"## Training run\n\n![train and eval loss, learning rate, tokens per second]({PLOT_NAME})\n")
    if (output_dir / LOG_NAME).is_file():
        table = eval_tasks_card_section(last_task_scores(read_run_log(output_dir)))
        if table:
            parts.append(table)
    return "\n".join(parts)


def add_plot_arguments(parser) -> None:
    parser.add_argument("out", help="a run's output folder (it holds train_log.jsonl)")


def run_plot(args) -> int:
    print(f"wrote {write_run_plot(args.out)}")
    return 0
