"""Monitoring for GRPO runs: our own completions table (TRL's crashes with image prompts in W&B), a rank
histogram, reward-time accounting, and PNG curves + a final metrics JSON that exist with or without W&B."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from transformers import TrainerCallback
from transformers.trainer_callback import ProgressCallback

from common.files import pyplot, save_figure, write_json_atomic


def wandb_credentials() -> bool:
    """Whether wandb will find credentials: a key or identity-token file in the environment, or a ``.netrc`` entry
    for the W&B host (what ``wandb login`` writes), read with wandb's own reader."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        from wandb.sdk.lib.wbauth.wbnetrc import read_netrc_auth

        return read_netrc_auth(host=os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")) is not None
    except (ImportError, AttributeError, ValueError):  # another wandb layout, or an entry wandb would refuse
        return False


def setup_wandb(output_dir: str, report_to) -> None:
    """Log W&B into the output dir: online when the user has credentials (``wandb login`` or a key in the
    environment), offline otherwise, unless WANDB_MODE says which."""
    if "wandb" not in (report_to or []):
        return
    if "WANDB_MODE" not in os.environ and not wandb_credentials():
        os.environ["WANDB_MODE"] = "offline"
    os.environ.setdefault("WANDB_DIR", str(Path(output_dir).resolve()))
    os.environ.setdefault("WANDB_CACHE_DIR", str(Path(output_dir).resolve() / ".wandb-cache"))
    Path(os.environ["WANDB_DIR"]).mkdir(parents=True, exist_ok=True)


class PhaseProgress(ProgressCallback):
    """A training phase as one progress bar: the logged metrics named in ``shown`` (log key → label) go to the bar's
    postfix instead of a printed dict per log, evaluation adds no bar of its own, and the phase ends with one line:
    steps, seconds, and each shown metric first → last. Every metric still reaches W&B, metrics.json and the
    trainer's log_history."""

    def __init__(self, phase: str, shown: dict[str, str]):
        super().__init__()
        self.phase, self.shown = phase, shown
        self.first: dict[str, float] = {}
        self.last: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def on_train_begin(self, args, state, control, **kw):
        super().on_train_begin(args, state, control, **kw)
        self._t0 = time.perf_counter()
        if self.training_bar is not None:
            self.training_bar.set_description(self.phase)

    def on_prediction_step(self, args, state, control, **kw):
        pass

    def on_log(self, args, state, control, logs=None, **kw):
        values = {
            label: float(logs[key])
            for key, label in self.shown.items()
            if isinstance((logs or {}).get(key), (int, float))
        }
        for label, v in values.items():
            self.first.setdefault(label, v)
            self.last[label] = v
        if values and self.training_bar is not None:
            self.training_bar.set_postfix({label: f"{v:.3g}" for label, v in self.last.items()}, refresh=False)

    def on_train_end(self, args, state, control, **kw):
        if not state.is_world_process_zero:
            return
        super().on_train_end(args, state, control, **kw)
        print(
            summary_line(self.phase, state.global_step, time.perf_counter() - self._t0, self.first, self.last),
            flush=True,
        )


def summary_line(phase: str, steps: int, seconds: float, first: dict[str, float], last: dict[str, float]) -> str:
    """``phase: N steps in S s; metric first → last, …`` (one metric logged once shows its single value)."""
    parts = [f"{k} {first[k]:.3g} → {last[k]:.3g}" if first[k] != last[k] else f"{k} {last[k]:.3g}" for k in last]
    return f"{phase}: {steps} steps in {seconds:.0f} s" + ("; " + ", ".join(parts) if parts else "")


def use_phase_progress(trainer, progress: PhaseProgress) -> None:
    """Swap the trainer's progress bar for ``progress`` (unless the run disabled tqdm: then logs print as usual)."""
    if trainer.args.disable_tqdm:
        return
    trainer.remove_callback(ProgressCallback)
    trainer.add_callback(progress)


def mode_of(trainer) -> str:
    """What TRL files a call's metrics under: "eval" while the trainer's model is in eval mode, else "train" (no
    trainer yet: training)."""
    return "eval" if trainer is not None and not trainer.model.training else "train"


def use_exact_metric_means(trainer, sources) -> None:
    """At each log, the rewards' means and the retrieval metrics as exact means over every completion since the last
    log, on all processes.

    TRL 1.16 pools each generation batch over processes but then averages the batch figures at each log: for a
    per-hit metric (mean hit rank), or a short last batch (evaluation scores many batches per log; one process takes
    a short last one as it is), that is a mean of batch means, not the mean over completions. Before TRL's ``log``
    averages, each such metric's batch figures are replaced by the one exact figure: each source's (sum, count) on
    this process (``take_totals``: the retrieval reward's metrics, each ``TimedReward``'s ``rewards/<name>/mean``),
    summed over every process (a collective: ``log`` runs on every process); ``reward``, TRL's weighted sum of the
    reward functions, from those exact means with TRL's own weights. (The std figures stay TRL's per-batch ones.)"""
    import torch
    from accelerate.utils import gather_object

    log = trainer.log
    for source in sources:
        source.follow(trainer)

    def log_with_exact_means(logs, *args, **kwargs):
        mode = mode_of(trainer)
        totals = {name: total for source in sources for name, total in source.take_totals(mode).items()}
        means = {}
        for name in sorted(set(gather_object(list(totals)))):
            local = torch.tensor(totals.get(name, [0.0, 0]), dtype=torch.float64, device=trainer.accelerator.device)
            total, count = trainer.accelerator.gather(local).view(-1, 2).sum(dim=0).tolist()
            if count:
                means[name] = trainer._metrics[mode][name] = [total / count]
        per_function = [means.get(f"rewards/{name}/mean") for name in trainer.reward_func_names]
        if None not in per_function:  # every function scores every completion: the weighted sum of their means
            weights = trainer.reward_weights.tolist()
            trainer._metrics[mode]["reward"] = [sum(w * m[0] for w, m in zip(weights, per_function))]
        return log(logs, *args, **kwargs)

    trainer.log = log_with_exact_means


class TimedReward:
    """Wraps a TRL reward function, adding up the seconds spent in it inside training steps (``seconds``) and outside
    them (``seconds_outside_steps``: evaluation, which the Trainer runs after ``on_step_end``) and the (sum, count)
    of its rewards per mode since the last log (``take_totals``); keeps the name TRL logs it under.
    ``RefinerMonitor`` says when a step runs (``in_step``); ``follow`` gives the trainer whose model's training flag
    tells evaluation calls apart."""

    def __init__(self, func):
        self.func = func
        self.__name__ = getattr(func, "__name__", type(func).__name__)
        self.seconds = 0.0
        self.seconds_outside_steps = 0.0
        self.in_step = False
        self.last: list[float] = []  # the latest training step's rewards (the table's; not an evaluation's)
        self.trainer = None
        self.totals: dict[str, list[float]] = {}  # mode → [sum, count] of the rewards returned since the last take

    def follow(self, trainer) -> None:
        self.trainer = trainer

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        rewards = self.func(*args, **kwargs)
        elapsed = time.perf_counter() - t0
        if self.in_step:
            self.seconds += elapsed
            self.last = rewards
        else:
            self.seconds_outside_steps += elapsed
        mode = mode_of(self.trainer)
        scored = [r for r in rewards if r is not None]  # TRL's None: not scored (a NaN it leaves out of the mean)
        total = self.totals.setdefault(mode, [0.0, 0])
        total[0], total[1] = total[0] + sum(scored), total[1] + len(scored)
        return rewards

    def take_totals(self, mode: str) -> dict[str, list[float]]:
        """{"rewards/<name>/mean": [sum, count]} over this process's calls in ``mode`` since the last take."""
        total = self.totals.pop(mode, None)
        return {f"rewards/{self.__name__}/mean": total} if total else {}


def image_label(key: str) -> str:
    """A short name for an image's cache key: the file name of ``path:…``, the first 12 hex digits of ``pixels:…``."""
    kind, _, rest = key.partition(":")
    if kind == "path" and rest:
        return Path(rest).name
    if kind == "pixels" and rest:
        return f"pixels:{rest[:12]}"
    return key


def caption(row: dict) -> str:
    """What the refiner saw and did, under its image: the query, the gold entity's rank and the reward."""
    rank = "not in the top depth" if row["rank"] is None else f"rank {row['rank']}"
    reward = "—" if row["total_reward"] is None else f"{row['total_reward']:.2f}"
    return (
        f"{image_label(row['image_key'])}: {row['query'] or '(unparseable)'} | gold {row['gold_title']} {rank} | "
        f"reward {reward}"
    )


class RefinerMonitor(TrainerCallback):
    """Every ``table_steps``: a W&B table of the latest completions (image, question, refined query, gold entity,
    rank, top-3 retrieved titles, rewards) and a rank histogram; also appended to ``samples.jsonl``.
    At the end: reward-time share of step time, ``curves.png`` and ``metrics.json`` in the output dir."""

    def __init__(
        self,
        retrieval_reward,
        format_reward: TimedReward,
        timed: list[TimedReward],
        table_steps: int,
        output_dir: str,
        max_rows: int = 16,
    ):
        self.retrieval, self.format, self.timed = retrieval_reward, format_reward, timed
        self.table_steps, self.max_rows = table_steps, max_rows
        self.output_dir = Path(output_dir)
        self.step_seconds = 0.0
        self._t0 = None
        self.reward_weights = (1.0, 1.0)  # format, retrieval: TRL's reward_weights, read from the trainer's args

    # -------------------------------------------------------------- timing

    def on_step_begin(self, args, state, control, **kw):
        self._t0 = time.perf_counter()
        for timed in self.timed:
            timed.in_step = True

    def on_step_end(self, args, state, control, **kw):
        for timed in self.timed:
            timed.in_step = False
        if self._t0 is not None:
            self.step_seconds += time.perf_counter() - self._t0
        if self.table_steps and state.global_step % self.table_steps == 0 and state.is_world_process_zero:
            self.reward_weights = tuple(args.reward_weights or (1.0, 1.0))
            self.log_table(state.global_step, to_wandb="wandb" in (args.report_to or []))

    def reward_seconds(self) -> float:
        """Seconds in the rewards inside training steps (what the share of step time compares)."""
        return sum(t.seconds for t in self.timed)

    # -------------------------------------------------------------- completions table

    def rows(self) -> list[dict]:
        """The latest completions (at most ``max_rows``) with their gold title, top-3 retrieved titles (one batched
        ``index.top_entities`` call: the exact ranker's scores on a GPU) and rewards."""
        last, fmt, index = self.retrieval.last[: self.max_rows], self.format.last, self.retrieval.index
        ranked = [
            i
            for i, rec in enumerate(last)
            if rec["query"] is not None and rec["image_key"] in self.retrieval.image_cache
        ]
        tops = (
            index.top_entities(
                np.stack([self.retrieval.image_cache[last[i]["image_key"]] for i in ranked]),
                [last[i]["query"] for i in ranked],
                alpha=self.retrieval.alpha,
                k=3,
            )
            if ranked
            else []
        )
        top_of = dict(zip(ranked, tops))
        rows, (wf, wr) = [], self.reward_weights  # the total TRL trains on: rewards weighted as it weighs them
        for i, rec in enumerate(last):
            top = [index.entity_titles.get(e) or e for e in top_of.get(i, [])]
            f = fmt[i] if i < len(fmt) else None
            rows.append(
                {
                    **rec,
                    "gold_title": index.entity_titles.get(rec["entity_id"], rec["entity_id"]),
                    "top3": top,
                    "format_reward": f,
                    "retrieval_reward": rec["reward"],
                    "total_reward": None if f is None else wf * f + wr * rec["reward"],
                }
            )
        return rows

    def log_table(self, step: int, to_wandb: bool = True) -> None:
        """The step's completions to ``samples.jsonl``, and to the W&B run when ``to_wandb`` (the run reports to W&B:
        another job's run left open in this process is not this run's)."""
        rows = self.rows()
        if not rows:
            return
        with open(self.output_dir / "samples.jsonl", "a", encoding="utf-8") as fh:
            for r in rows:
                fh.write(json.dumps({"step": step, **r}, default=str) + "\n")
        if not to_wandb:
            return
        try:
            import wandb
        except ImportError:
            return
        if wandb.run is None:
            return
        # wandb (0.31) writes a table's image cells as the string "Image" in offline mode, so the images go to their
        # own panel (one per row, the caption saying what the refiner did) and the table names each by its file name
        cols = [
            "step",
            "image",
            "question",
            "refined_query",
            "gold_entity",
            "rank",
            "top3_retrieved",
            "format_reward",
            "retrieval_reward",
            "total_reward",
        ]
        table, images = wandb.Table(columns=cols), []
        for r in rows:
            table.add_data(
                step,
                image_label(r["image_key"]),
                r.get("question") or "",
                r["query"] or "",
                r["gold_title"],
                -1 if r["rank"] is None else r["rank"],
                ", ".join(r["top3"]),
                r["format_reward"],
                r["retrieval_reward"],
                r["total_reward"],
            )
            img = self.retrieval.images.get(r["image_key"])
            if img is not None:
                images.append(wandb.Image(img, caption=caption(r)))
        # process 0's completions of the step (1/N of them with N processes: a sample, like the table; the hit@k
        # metrics are pooled over every process)
        ranks = [(self.retrieval.depth + 1) if x["rank"] is None else x["rank"] for x in self.retrieval.last]
        # "refined_queries", not "completions": TRL's own table (log_completions) is logged under that name
        wandb.log(
            {"refined_queries": table, "completion_images": images, "rank_histogram": wandb.Histogram(ranks)},
            commit=False,
        )

    # -------------------------------------------------------------- end of training

    def on_train_end(self, args, state, control, **kw):
        if not state.is_world_process_zero:
            return
        share = self.reward_seconds() / self.step_seconds if self.step_seconds else float("nan")
        self.summary = {
            "reward_seconds": self.reward_seconds(),
            "step_seconds": self.step_seconds,
            "reward_time_share": share,
            "eval_reward_seconds": sum(t.seconds_outside_steps for t in self.timed),
            "global_step": state.global_step,
        }
        print(
            f"reward time: {self.reward_seconds():.1f}s of {self.step_seconds:.1f}s in training steps "
            f"({100 * share:.1f}%)"
        )
        write_curves(state.log_history, self.output_dir / "curves.png")
        final = state.log_history[-1] if state.log_history else {}
        write_json_atomic(
            self.output_dir / "metrics.json", {**self.summary, "final_log": final, "log_history": state.log_history}
        )


def write_curves(log_history: list[dict], path: Path) -> None:
    """Mean total / format / retrieval reward and hit@1 / hit@10 per logged step."""
    plt = pyplot()

    logs = [h for h in log_history if "reward" in h and "step" in h]
    if not logs:
        return
    steps = [h["step"] for h in logs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for key, label in [
        ("reward", "total"),
        ("rewards/format_reward/mean", "format"),
        ("rewards/retrieval_reward/mean", "retrieval"),
    ]:
        if any(key in h for h in logs):
            a.plot(steps, [h.get(key, float("nan")) for h in logs], label=label)
    a.set_title("mean reward")
    a.set_xlabel("step")
    a.legend()
    for key in ("retrieval/hit@1", "retrieval/hit@10"):
        if any(key in h for h in logs):
            b.plot(steps, [h.get(key, float("nan")) for h in logs], label=key.split("/")[1])
    b.set_title("hit rate of sampled queries")
    b.set_xlabel("step")
    b.legend()
    for ax in (a, b):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
