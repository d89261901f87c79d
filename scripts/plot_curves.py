#!/usr/bin/env python
"""Learning curves: episode return vs env frames and vs wall-clock hours, to one PNG.

Reads each run directory's ``metrics.jsonl`` (written by ``python -m impala_rep.launch``:
one record per progress line with ``episode_return`` = mean return of the last 100
finished episodes, ``agent_steps``, ``env_frames`` and ``time``), draws both curves, and
overlays the evaluation reports ``RUN_DIR/eval/*.json`` (``mean_return`` ± ``std_return``
at the policy's ``agent_steps``, written by ``python -m impala_rep.evaluate``) unless
``--no-eval``. Prints markdown tables (env frames, agent steps, hours, return) for
docs/RESULTS.md on stdout; with ``--at-steps`` and/or ``--at-minutes``, also one row per run
that compares the runs at the same agent steps and the same training minutes (with each run's
agent steps, rate, the learner's time waiting for batches, and its evaluations of its last
policy). ``--no-plot`` prints the tables without drawing.

Wall-clock hours count from the run's first record. A run resumed on the same logdir
appends to its ``metrics.jsonl``; a gap between consecutive records longer than
``--max-gap`` seconds (the run was stopped) counts as one typical record interval, so the
hours are hours of training, not of calendar time. Records of training a resume lost (a run
stopped after its last checkpoint trains those steps again) are not drawn: a record with no
fewer agent steps than a later one; their time still counts.

Usage::

    .venv/bin/python scripts/plot_curves.py runs/cartpole-swingup --out docs/cartpole.png
    .venv/bin/python scripts/plot_curves.py runs/a runs/b --labels "lr 6e-4" "lr 3e-4" --out cmp.png
    .venv/bin/python scripts/plot_curves.py runs/a runs/b --no-plot --at-steps 500000 1000000 --at-minutes 10 30
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import statistics
import sys
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["CurveError", "Run", "load_metrics", "load_evals", "load_run", "superseded", "training_hours", "markdown_tables",
           "comparison_table", "plot"]


class CurveError(ValueError):
    """A run directory cannot be plotted; the message says why and what to do."""


@dataclasses.dataclass
class Run:
    label: str
    path: str
    records: List[Dict[str, Any]]   # the metrics records in file order, less those a resume superseded
    hours: List[float]              # training hours of each record
    action_repeat: float            # env frames per agent step
    evals: List[Dict[str, Any]]     # eval reports sorted by agent_steps

    def curve(self):
        """(env frames, hours, return) of the records that carry an ``episode_return``."""
        rows = [(r.get("env_frames", r["agent_steps"] * self.action_repeat), h, r["episode_return"])
                for r, h in zip(self.records, self.hours) if _number(r.get("episode_return"))]
        return [list(c) for c in zip(*rows)] if rows else [[], [], []]

    def hours_at(self, agent_steps: float) -> float:
        """Training hours when the learner had trained on ``agent_steps`` (interpolated)."""
        points = [(r["agent_steps"], h) for r, h in zip(self.records, self.hours)]
        if agent_steps <= points[0][0]:
            return points[0][1]
        for (s0, h0), (s1, h1) in zip(points, points[1:]):
            if s0 <= agent_steps <= s1:
                return h0 if s1 == s0 else h0 + (h1 - h0) * (agent_steps - s0) / (s1 - s0)
        return points[-1][1]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _metrics_path(run_dir: str) -> str:
    if os.path.isfile(run_dir) and run_dir.endswith(".jsonl"):
        return run_dir
    if not os.path.exists(run_dir):
        raise CurveError(f"{run_dir} does not exist; pass a run directory (the --logdir of python -m impala_rep.launch).")
    if not os.path.isdir(run_dir):
        raise CurveError(f"{run_dir} is not a directory or a metrics.jsonl file; pass a run directory (the --logdir of a run).")
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise CurveError(
            f"{run_dir} has no metrics.jsonl; pass a run directory written by python -m impala_rep.launch "
            "(its --logdir), after its first progress line."
        )
    return path


def load_metrics(run_dir: str) -> List[Dict[str, Any]]:
    """The records of ``RUN_DIR/metrics.jsonl`` (or of a ``.jsonl`` file given directly).

    A half-written last line (a run still writing) is skipped; any other line that is not a
    JSON object, or a record without numeric ``agent_steps`` and ``time``, raises
    :class:`CurveError`, as do a missing or empty file.
    """
    path = _metrics_path(run_dir)
    with open(path) as f:
        lines = f.read().splitlines()
    numbered = [(i + 1, line) for i, line in enumerate(lines) if line.strip()]
    if not numbered:
        raise CurveError(
            f"{path} is empty: the run has not written a progress record yet (the first comes "
            "--log-interval seconds after training starts); wait for it or check the run's log."
        )
    records = []
    for index, (lineno, line) in enumerate(numbered):
        try:
            record = json.loads(line)
        except ValueError as exc:
            if index == len(numbered) - 1:
                continue  # the run is writing this line right now
            raise CurveError(f"line {lineno} of {path} is not JSON ({exc}); the file is corrupt.") from None
        if not isinstance(record, dict):
            raise CurveError(f"line {lineno} of {path} is not a JSON object; the file is not a metrics log.")
        for key in ("agent_steps", "time"):
            if not _number(record.get(key)):
                raise CurveError(
                    f"line {lineno} of {path} has no numeric {key!r}; is this a metrics.jsonl of impala_rep?"
                )
        records.append(record)
    if not records:
        raise CurveError(f"{path} holds only a half-written record; wait for the next progress line.")
    return records


def training_hours(times: Sequence[float], max_gap_s: float = 300.0) -> List[float]:
    """Hours since the first record, counting a gap over ``max_gap_s`` as a typical interval."""
    if not times:
        return []
    gaps = [b - a for a, b in zip(times, times[1:])]
    typical = statistics.median([g for g in gaps if 0 <= g <= max_gap_s] or [0.0])
    out, elapsed = [0.0], 0.0
    for gap in gaps:
        elapsed += gap if 0 <= gap <= max_gap_s else typical
        out.append(elapsed / 3600.0)
    return out


def load_evals(run_dir: str) -> List[Dict[str, Any]]:
    """Eval reports of ``RUN_DIR/eval/*.json`` with ``mean_return`` and ``agent_steps``.

    Reports that cannot be read or lack those keys are skipped with a warning on stderr.
    """
    if not os.path.isdir(run_dir):
        return []
    reports = []
    for path in sorted(glob.glob(os.path.join(run_dir, "eval", "*.json"))):
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError) as exc:
            print(f"plot_curves: skipping {path}: not a readable JSON report ({exc}).", file=sys.stderr)
            continue
        if not isinstance(report, dict) or not _number(report.get("mean_return")) or not _number(report.get("agent_steps")):
            print(f"plot_curves: skipping {path}: it lacks a numeric mean_return or agent_steps.", file=sys.stderr)
            continue
        report["path"] = path
        reports.append(report)
    return sorted(reports, key=lambda r: r["agent_steps"])


def _action_repeat(records: Sequence[Dict[str, Any]]) -> float:
    for record in reversed(records):
        if _number(record.get("env_frames")) and record["agent_steps"] > 0:
            return record["env_frames"] / record["agent_steps"]
    return 1.0


def superseded(records: Sequence[Dict[str, Any]]) -> List[bool]:
    """Which records a resume superseded: a run stopped after its last checkpoint and resumed
    from it trains those agent steps again, so a record with no fewer agent steps than a
    later one describes training that was lost."""
    out, fewest = [False] * len(records), math.inf
    for i in range(len(records) - 1, -1, -1):
        steps = records[i]["agent_steps"]
        out[i] = steps >= fewest
        fewest = min(fewest, steps)
    return out


def load_run(run_dir: str, label: Optional[str] = None, evals: bool = True, max_gap_s: float = 300.0) -> Run:
    loaded = load_metrics(run_dir)
    # The hours count the lost training's time too (it was spent); its records are not drawn.
    hours = training_hours([r["time"] for r in loaded], max_gap_s)
    kept = [i for i, lost in enumerate(superseded(loaded)) if not lost]
    records = [loaded[i] for i in kept]
    run = Run(
        label=label or os.path.basename(os.path.normpath(run_dir)),
        path=run_dir,
        records=records,
        hours=[hours[i] for i in kept],
        action_repeat=_action_repeat(records),
        evals=load_evals(run_dir) if evals else [],
    )
    if not run.curve()[0] and not run.evals:
        raise CurveError(
            f"{run_dir} has {len(records)} progress record(s) but none with an episode_return: no episode "
            "has finished yet; plot again once episodes complete."
        )
    return run


def _pick(n: int, rows: int) -> List[int]:
    """``rows`` indices spread evenly over ``range(n)``, always with the first and last."""
    if n <= rows:
        return list(range(n))
    if rows == 1:
        return [n - 1]
    return sorted({round(i * (n - 1) / (rows - 1)) for i in range(rows)})


def markdown_tables(runs: Sequence[Run], rows: int = 8) -> str:
    """Markdown tables: the training curve at ``rows`` points per run, then the eval reports."""
    out = ["| run | env frames | agent steps | hours | return (mean of last 100 episodes) |",
           "|---|---:|---:|---:|---:|"]
    for run in runs:
        with_return = [(r, h) for r, h in zip(run.records, run.hours) if _number(r.get("episode_return"))]
        for i in _pick(len(with_return), rows):
            r, h = with_return[i]
            frames = r.get("env_frames", r["agent_steps"] * run.action_repeat)
            out.append(f"| {run.label} | {int(frames):,} | {int(r['agent_steps']):,} | {h:.2f} | {r['episode_return']:.1f} |")
    if any(run.evals for run in runs):
        out += ["", "| run | env frames | agent steps | hours | eval return (mean ± std) | episodes |",
                "|---|---:|---:|---:|---:|---:|"]
        for run in runs:
            for e in run.evals:
                std = f" ± {e['std_return']:.1f}" if _number(e.get("std_return")) else ""
                out.append(
                    f"| {run.label} | {int(e['agent_steps'] * run.action_repeat):,} | {int(e['agent_steps']):,} | "
                    f"{run.hours_at(e['agent_steps']):.2f} | {e['mean_return']:.1f}{std} | {e.get('episodes', '?')} |"
                )
    return "\n".join(out)


def _start_hours(run: Run) -> float:
    """Training hours before the run's first record: the learner's ``train_seconds`` there (the
    first record comes ``--log-interval`` after training starts); 0 where not recorded."""
    first = run.records[0].get("train_seconds")
    return first / 3600.0 if _number(first) and first > 0 else 0.0


def _returns(run: Run):
    """(agent steps, training hours since training started, return) of the records that carry an
    ``episode_return``."""
    start = _start_hours(run)
    return [(r["agent_steps"], start + h, r["episode_return"]) for r, h in zip(run.records, run.hours)
            if _number(r.get("episode_return"))]


def return_at_steps(run: Run, agent_steps: float) -> Optional[float]:
    """The return of the first record at or past ``agent_steps``; None if the run never got there."""
    for steps, _, ret in _returns(run):
        if steps >= agent_steps:
            return ret
    return None


def return_at_minutes(run: Run, minutes: float) -> Optional[float]:
    """The return of the last record at or before ``minutes`` of training; None if the run trained
    for less than that, less one record interval (records come ``--log-interval`` apart), or had
    no return yet."""
    rows = _returns(run)
    if not rows:
        return None
    gaps = [b - a for a, b in zip(run.hours, run.hours[1:])]
    interval = statistics.median(gaps) if gaps else 0.0
    hours = minutes / 60.0
    if _start_hours(run) + run.hours[-1] < hours - interval - 1e-9:
        return None
    before = [ret for _, h, ret in rows if h <= hours + 1e-9]
    return before[-1] if before else None


def _cell(value: Optional[float]) -> str:
    return "—" if value is None else f"{value:.0f}"


def _last_evals(run: Run) -> str:
    if not run.evals:
        return "—"
    last = max(e["agent_steps"] for e in run.evals)
    cells = []  # a report repeated (the same policy, episodes and seed) is shown once
    for e in run.evals:
        if e["agent_steps"] == last:
            std = f" ± {e['std_return']:.1f}" if _number(e.get("std_return")) else ""
            cell = f"{e['mean_return']:.1f}{std} ({e.get('episodes', '?')})"
            if cell not in cells:
                cells.append(cell)
    return ", ".join(cells)


def comparison_table(runs: Sequence[Run], at_steps: Sequence[float] = (), at_minutes: Sequence[float] = ()) -> str:
    """One markdown row per run: its agent steps, minutes of training (from the start of training,
    not from the first record), agent steps a second and the
    learner's mean share of time waiting for a batch (``time_share/wait_batch``, where recorded);
    its return at each of ``at_steps`` agent steps and ``at_minutes`` minutes (— where the run did
    not get there); and its evaluations of its last evaluated policy (mean ± std (episodes))."""
    head = ["run", "agent steps", "minutes", "agent steps/s", "learner waiting"]
    head += [f"return at {s:,.0f} steps" for s in at_steps] + [f"return at {m:g} min" for m in at_minutes]
    head.append("eval of the last evaluated policy")
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 2) + "---|"]
    for run in runs:
        last = run.records[-1]
        minutes = (_start_hours(run) + run.hours[-1]) * 60.0
        seconds = last["train_seconds"] if _number(last.get("train_seconds")) and last["train_seconds"] > 0 else minutes * 60
        waits = [r["time_share/wait_batch"] for r in run.records if _number(r.get("time_share/wait_batch"))]
        cells = [run.label, f"{int(last['agent_steps']):,}", f"{minutes:.1f}",
                 f"{last['agent_steps'] / seconds:,.0f}" if seconds > 0 else "—",
                 f"{statistics.fmean(waits):.0%}" if waits else "—"]
        cells += [_cell(return_at_steps(run, s)) for s in at_steps]
        cells += [_cell(return_at_minutes(run, m)) for m in at_minutes]
        cells.append(_last_evals(run))
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(runs: Sequence[Run], out: str, title: Optional[str] = None) -> None:
    """Draws return vs env frames (left) and vs training hours (right) to the PNG ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_frames, ax_hours) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        frames, hours, returns = run.curve()
        ax_frames.plot(frames, returns, color=color, label=f"{run.label} (training)")
        ax_hours.plot(hours, returns, color=color, label=f"{run.label} (training)")
        if run.evals:
            steps = [e["agent_steps"] for e in run.evals]
            means = [e["mean_return"] for e in run.evals]
            stds = [e["std_return"] if _number(e.get("std_return")) else 0.0 for e in run.evals]
            kw = dict(color=color, fmt="o", capsize=3, markersize=5, label=f"{run.label} (eval)")
            ax_frames.errorbar([s * run.action_repeat for s in steps], means, yerr=stds, **kw)
            ax_hours.errorbar([run.hours_at(s) for s in steps], means, yerr=stds, **kw)
    ax_frames.set_xlabel("env frames")
    ax_frames.set_ylabel("episode return")
    ax_hours.set_xlabel("training wall-clock hours")
    for ax in (ax_frames, ax_hours):
        ax.grid(True, alpha=0.3)
    ax_frames.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    ax_hours.legend(loc="best", fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(out))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    from impala_rep.flags import UsageError, check_output_path, positive_float

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (or metrics.jsonl files)")
    parser.add_argument("--out", default="curves.png", help="PNG to write (default curves.png)")
    parser.add_argument("--labels", nargs="+", default=None, help="one legend label per run (default: directory names)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument("--no-eval", action="store_true", help="do not overlay RUN_DIR/eval/*.json reports")
    parser.add_argument("--rows", type=int, default=8, help="rows per run in the markdown table (default 8)")
    parser.add_argument("--max-gap", type=positive_float, default=300.0,
                        help="seconds between records beyond which the run counts as stopped (default 300)")
    parser.add_argument("--at-steps", nargs="+", type=positive_float, default=[], metavar="N",
                        help="also print a row per run with its return at these agent steps (e.g. 5e5 1e6)")
    parser.add_argument("--at-minutes", nargs="+", type=positive_float, default=[], metavar="M",
                        help="... and at these minutes of training")
    parser.add_argument("--no-plot", action="store_true", help="print the tables only; write no PNG")
    args = parser.parse_args(argv)
    if args.labels is not None and len(args.labels) != len(args.runs):
        parser.error(f"--labels gives {len(args.labels)} label(s) for {len(args.runs)} run(s); give one per run.")
    if args.rows < 1:
        parser.error(f"--rows must be at least 1, got {args.rows}.")
    if args.no_plot:
        return args
    if not args.out.lower().endswith(".png"):
        parser.error(f"--out must name a .png file, got {args.out!r}.")
    try:
        check_output_path(args.out, "--out")
    except UsageError as exc:
        parser.error(str(exc))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    labels = args.labels or [None] * len(args.runs)
    try:
        runs = [load_run(d, label, evals=not args.no_eval, max_gap_s=args.max_gap) for d, label in zip(args.runs, labels)]
    except CurveError as exc:
        print(f"plot_curves: {exc}", file=sys.stderr)
        return 2
    if not args.no_plot:
        plot(runs, args.out, args.title)
    print(markdown_tables(runs, args.rows))
    if args.at_steps or args.at_minutes:
        print()
        print(comparison_table(runs, args.at_steps, args.at_minutes))
    if not args.no_plot:
        print(f"\nwrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
