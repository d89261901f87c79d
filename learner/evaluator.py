"""Evaluation of each exported policy during training, in a subprocess beside the learner.

The learner's progress line reports the return of the actors' episodes. Those are played by a
policy that changes while they run (the actors fetch new parameters between unrolls), and can
differ from what the saved policy scores on its own: a cartpole run with experience replay
showed 630 in training while its exported policy, frozen, scored 400 (``docs/RESULTS.md``).
This module runs ``python -m impala_rep.evaluate`` on the policy exported with each checkpoint,
so the run's log, TensorBoard (``eval/return``) and ``RUN_DIR/eval/eval-STEP.json`` carry the
return of the policy a user would load.

TensorFlow-free; the evaluator is its own process (MuJoCo's renderer and TensorFlow must not
share one), at the actors' lowered CPU priority with one BLAS and render thread. One
evaluation runs at a time: a checkpoint that comes while one runs is not evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from typing import List, Optional

from impala_rep.plan import actor_process_env

__all__ = ["EvalResult", "PolicyEvaluator"]

log = logging.getLogger("impala_rep.learner")


@dataclasses.dataclass(frozen=True)
class EvalResult:
    learner_step: int
    agent_steps: int
    mean_return: float
    std_return: float
    episodes: int
    greedy: bool


class PolicyEvaluator:
    """Starts and collects ``impala_rep.evaluate`` runs on ``RUN_DIR/policy``.

    Args:
      run_dir: the run directory (its ``policy/`` export is evaluated; reports go to ``eval/``).
      episodes: episodes per evaluation (at least 1).
      greedy: act with the policy's mode instead of sampling.
      seed: the evaluation's seed (the same for every checkpoint, so they face the same starts).
      nice: CPU priority the evaluator gives up, 0-19.
    """

    def __init__(self, run_dir: str, episodes: int, greedy: bool = False, seed: int = 0, nice: int = 10):
        if int(episodes) < 1:
            raise ValueError(f"eval-episodes must be at least 1 to evaluate, got {episodes}.")
        if not 0 <= int(nice) <= 19:
            raise ValueError(f"the evaluator's nice must be between 0 and 19, got {nice}.")
        self.run_dir = run_dir
        self.episodes = int(episodes)
        self.greedy = bool(greedy)
        self.seed = int(seed)
        self.nice = int(nice)
        self._proc: Optional[subprocess.Popen] = None
        self._report: Optional[str] = None
        self._step = -1
        self._log_file = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self, report: str) -> List[str]:
        cmd = [sys.executable, "-m", "impala_rep.evaluate", self.run_dir, "--episodes", str(self.episodes),
               "--seed", str(self.seed), "--report", report]
        return cmd + (["--greedy"] if self.greedy else []) + (["--nice", str(self.nice)] if self.nice else [])

    def start(self, learner_step: int) -> bool:
        """Evaluates the policy just exported at ``learner_step``; False if one still runs."""
        if self.running:
            log.info("evaluation of an earlier policy still running: not evaluating learner step %d", learner_step)
            return False
        self._collect_log()
        eval_dir = os.path.join(self.run_dir, "eval")
        os.makedirs(eval_dir, exist_ok=True)
        self._step = int(learner_step)
        self._report = os.path.join(eval_dir, f"eval-{self._step}.json")
        env = actor_process_env()
        self._log_file = open(os.path.join(eval_dir, "evaluator.log"), "ab")  # pylint: disable=consider-using-with
        # The child lowers its own priority (--nice). No preexec_fn: it would run Python in the
        # forked child of this process, whose gRPC threads are live, and gRPC's fork handlers
        # then abort the child now and then (seen: exit status -6, "epoll_wait error: Bad file
        # descriptor", one evaluation of three lost in a cartpole run).
        self._proc = subprocess.Popen(  # pylint: disable=consider-using-with
            self.command(self._report), stdout=self._log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env)
        return True

    def poll(self) -> Optional[EvalResult]:
        """The finished evaluation's result, once; None while it runs or when none was started."""
        if self._proc is None or self._proc.poll() is None:
            return None
        code, report = self._proc.returncode, self._report
        self._proc = None
        self._collect_log()
        if code != 0:
            log.warning("evaluating the policy exported at learner step %d failed (exit status %d); see %s",
                        self._step, code, os.path.join(self.run_dir, "eval", "evaluator.log"))
            return None
        try:
            with open(report, encoding="utf-8") as f:
                data = json.load(f)
            return EvalResult(int(data["learner_step"]), int(data["agent_steps"]), float(data["mean_return"]),
                              float(data["std_return"]), int(data["episodes"]), bool(data["greedy"]))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("could not read the evaluation report %s: %s", report, exc)
            return None

    def wait(self, timeout_s: float) -> Optional[EvalResult]:
        """Waits up to ``timeout_s`` for the running evaluation (then stops it); its result or None."""
        if self._proc is None:
            return None
        try:
            self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("evaluating the policy exported at learner step %d took over %.0f s; stopped it",
                        self._step, timeout_s)
            self.close()
            return None
        return self.poll()

    def close(self) -> None:
        """Stops a running evaluation."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        self._collect_log()

    def _collect_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
