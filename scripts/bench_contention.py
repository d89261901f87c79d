#!/usr/bin/env python
"""The ceiling pieces beside each other: how much each slows while another runs on the next core.

``scripts/benchmark.py`` times each piece (env, policy inference, learner step) alone on an
idle machine, and its ceiling assumes the pieces keep those rates when actors and learner
share the machine. This script tests that assumption on one workload. It times:

* each piece alone, as ``benchmark.py`` does (one process, one thread);
* each actor-side piece (``env``, ``inference``) while the learner piece runs in another
  process, and the learner piece while each actor-side piece runs.

The neighbour starts first and gets ``--settle`` seconds (its imports, and the learner's
graph tracing and warm-up) before the timed piece starts; it is stopped (its whole process
group) as soon as the timed piece ends, and in any case runs at most ``--settle`` plus
``--timeout`` seconds. Nothing else should run on the machine meanwhile.

The report gives each piece's rate alone and beside its neighbour, the slowdown, and two
ceilings for ``--cores`` (default: the cores this process may use):

* ``ceiling_alone``: ``benchmark.py``'s formula on the rates alone;
* ``ceiling_beside``: the same formula on the env and inference rates beside the learner,
  and the learner's rate beside the actor-side piece that costs more per agent step (the
  one an actor process spends most of its time in).

The end-to-end rate cannot beat the second either, unless the pipeline overlaps work in a
way the pieces do not; the gap between the two ceilings is the part of the pipeline's
shortfall that is the machine's (shared caches and memory bandwidth), not the code's.

    .venv/bin/python scripts/bench_contention.py --workload synthetic --seconds 12
    .venv/bin/python scripts/bench_contention.py --workload dmc/cartpole-swingup --batch 16 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional

SCRIPTS = Path(__file__).resolve().parent
if str(SCRIPTS) not in sys.path:
    sys.path.insert(0, str(SCRIPTS))

import benchmark  # noqa: E402  (scripts/benchmark.py: the pieces and the ceiling formula)

ACTOR_SIDE = ("env", "inference")


def check_piece(piece: str, learner_input: Optional[tuple]) -> None:
    """``ValueError`` for an unknown piece, or for the learner without its input shapes."""
    if piece not in ACTOR_SIDE + ("learner",):
        raise ValueError(f"unknown piece {piece!r}; the pieces are env, inference and learner.")
    if piece == "learner" and learner_input is None:
        raise ValueError("the learner piece needs the inference piece's input shapes; time inference first.")


def child_args(piece: str, workload: str, batch: int, seconds: float) -> List[str]:
    """``benchmark.py``'s arguments that time an actor-side piece (``env``, ``inference``)."""
    args = ["--child", piece, "--workloads", workload, "--piece-seconds", str(seconds)]
    return args + ["--batch", str(batch)] if piece == "inference" else args


def piece_command(piece: str, workload: str, batch: int, seconds: float, timeout: float,
                  learner_input: Optional[tuple] = None) -> List[str]:
    """The command that runs ``piece`` for ``seconds`` (the learner needs ``learner_input``:
    the frame shape, stack depth and action size the inference piece reports)."""
    check_piece(piece, learner_input)
    if piece in ACTOR_SIDE:
        return benchmark.child_command(child_args(piece, workload, batch, seconds))
    return benchmark.learner_command(seconds, timeout, *learner_input)


def time_piece(piece: str, workload: str, batch: int, seconds: float, timeout: float,
               learner_input: Optional[tuple] = None) -> Dict[str, Any]:
    """Times ``piece`` as ``benchmark.py`` does: its record (``agent_steps_per_s`` and the
    rest), or ``{"error": sentence}``."""
    check_piece(piece, learner_input)
    if piece in ACTOR_SIDE:
        return benchmark._run_child(child_args(piece, workload, batch, seconds), timeout)
    return benchmark.measure_learner(seconds, timeout, *learner_input)


def beside(piece: str, neighbour: str, neighbour_command: List[str], settle: float,
           run: Callable[[], Dict[str, Any]]) -> Dict[str, Any]:
    """Times ``piece`` (``run()``) while ``neighbour`` runs in its own process group, then
    stops the neighbour."""
    proc = subprocess.Popen(neighbour_command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=benchmark._env(), cwd=str(benchmark.REPO), start_new_session=True)
    try:
        time.sleep(settle)
        if proc.poll() is not None:
            return {"error": f"the {neighbour} piece beside it exited early (exit code {proc.returncode}); "
                             f"run it alone to see why."}
        result = run()
        if proc.poll() is not None:
            result = {"error": f"the {neighbour} piece beside it ended before the {piece} piece did; "
                               f"the neighbour's time is too short or it failed."}
        return dict(result, beside=neighbour)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def summarise(alone: Mapping[str, float], beside_rates: Mapping[str, float], cores: float) -> Dict[str, Any]:
    """Slowdowns and the two ceilings from the rates (agent steps/s) alone and beside.

    ``beside_rates`` keys are ``"PIECE|NEIGHBOUR"``: ``env|learner``, ``inference|learner``,
    ``learner|env`` and ``learner|inference``.
    """
    slowdown = {key: 1.0 - rate / alone[key.split("|")[0]] for key, rate in beside_rates.items()}
    # The learner's neighbour in a run is mostly the actor-side piece that costs more per step.
    heavier = "env" if alone["env"] <= alone["inference"] else "inference"
    ceiling_alone = benchmark.ceiling_agent_steps_per_s(alone["env"], alone["inference"], alone["learner"], cores)
    ceiling_beside = benchmark.ceiling_agent_steps_per_s(
        beside_rates["env|learner"], beside_rates["inference|learner"], beside_rates[f"learner|{heavier}"], cores)
    return {"slowdown": slowdown, "learner_neighbour": heavier, "ceiling_alone": ceiling_alone,
            "ceiling_beside": ceiling_beside, "ceiling_beside_over_alone": ceiling_beside / ceiling_alone}


def parse_args(argv=None) -> argparse.Namespace:
    from impala_rep.flags import positive_float

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="synthetic", choices=list(benchmark.WORKLOADS),
                        help="which workload's pieces (default synthetic)")
    parser.add_argument("--batch", type=int, default=32,
                        help="the policy's batch: envs per actor process (default 32, the launcher's plan for "
                             "synthetic's 32 actors on 2 cores; 16 for pixel cartpole's 2 processes)")
    parser.add_argument("--seconds", type=positive_float, default=12.0, help="each timed piece's window (default 12)")
    parser.add_argument("--settle", type=positive_float, default=15.0,
                        help="seconds the neighbour runs before the timed piece starts (default 15)")
    parser.add_argument("--cores", type=positive_float, default=None, help="cores for the ceilings (default: this process's)")
    parser.add_argument("--timeout", type=positive_float, default=300.0, help="limit for each timed piece (default 300)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a summary")
    args = parser.parse_args(argv)
    if args.batch <= 0:
        parser.error(f"--batch must be positive, got {args.batch}.")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if benchmark.available_cores() < 2:
        print("error: timing pieces beside each other needs at least 2 cores; this process may use "
              f"{benchmark.available_cores()}.", file=sys.stderr)
        return 2
    cores = args.cores or benchmark.available_cores()

    def report(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    def timed(piece: str, learner_input=None) -> Dict[str, Any]:
        return time_piece(piece, args.workload, args.batch, args.seconds, args.timeout, learner_input)

    results: Dict[str, Dict[str, Any]] = {}
    report(f"{args.workload}: inference alone (batch {args.batch}) ...")
    results["inference"] = timed("inference")
    if "error" in results["inference"]:
        print(f"error: {results['inference']['error']}", file=sys.stderr)
        return 1
    # The learner trains on what the policy sees: its frames, stack depth and action size.
    learner_input = benchmark.learner_input(results["inference"])
    for piece in ("env", "learner"):
        report(f"{args.workload}: {piece} alone ...")
        results[piece] = timed(piece, learner_input)
    # The neighbour runs at most this long; it is stopped as soon as the timed piece ends.
    long_seconds = args.settle + args.timeout
    pairs = [("env", "learner"), ("inference", "learner"), ("learner", "env"), ("learner", "inference")]
    for piece, neighbour in pairs:
        report(f"{args.workload}: {piece} beside {neighbour} ...")
        # bench_learner stops its own child after its --timeout: past the neighbour's seconds.
        neighbour_command = piece_command(neighbour, args.workload, args.batch, long_seconds,
                                          long_seconds + args.timeout, learner_input)
        results[f"{piece}|{neighbour}"] = beside(piece, neighbour, neighbour_command, args.settle,
                                                 lambda: timed(piece, learner_input))
    out: Dict[str, Any] = {"machine": benchmark.machine_info(), "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                           "settings": vars(args), "cores": cores,
                           "pieces": {k: {f: v[f] for f in ("agent_steps_per_s", "error", "beside") if f in v}
                                      for k, v in results.items()}}
    errors = {k: v["error"] for k, v in results.items() if "error" in v}
    if errors:
        out["errors"] = errors
    else:
        rates = {k: v["agent_steps_per_s"] for k, v in results.items()}
        out.update(summarise({k: rates[k] for k in ("env", "inference", "learner")},
                             {k: v for k, v in rates.items() if "|" in k}, cores))
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        print(summary(out))
    return 1 if errors else 0


def summary(out: Mapping[str, Any]) -> str:
    pieces = out["pieces"]
    lines = [f"== {out['settings']['workload']} (batch {out['settings']['batch']}), agent steps/s on one core"]
    for piece in ("env", "inference", "learner"):
        row = f"  {piece:<10} alone {pieces[piece].get('agent_steps_per_s', float('nan')):>11,.1f}"
        for key, value in pieces.items():
            if key.startswith(piece + "|"):
                rate = value.get("agent_steps_per_s")
                if rate is None:
                    row += f"   beside {key.split('|')[1]}: {value['error']}"
                else:
                    row += f"   beside {key.split('|')[1]} {rate:>11,.1f}"
                    if key in out.get("slowdown", {}):
                        slow = out["slowdown"][key]
                        row += f" ({slow:.1%} slower)" if slow >= 0 else f" ({-slow:.1%} faster)"
        lines.append(row)
    if "ceiling_alone" in out:
        lines.append(f"  ceiling on {out['cores']:g} cores: alone {out['ceiling_alone']:,.1f}, beside "
                     f"{out['ceiling_beside']:,.1f} ({out['ceiling_beside_over_alone']:.3f} of it; the learner "
                     f"beside {out['learner_neighbour']})")
    for key, error in out.get("errors", {}).items():
        lines.append(f"  {key}: {error}")
    return "\n".join(lines)


if __name__ == "__main__":
    from benchmark import stop_on_sigterm

    stop_on_sigterm()
    sys.exit(main())
