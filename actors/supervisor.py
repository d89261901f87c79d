"""Supervises actor processes: starts them, restarts crashed ones (with a limit), stops all.

TensorFlow-free. Each actor process is a fresh interpreter (``python -m actors.run ...``),
never a fork of the learner, so it never inherits TensorFlow. Its output goes to a log file
whose last lines are quoted when it crashes, or, without a log directory, to this process's
own stdout and stderr.

Usage::

    sup = ActorSupervisor([cmd0, cmd1], log_dir="run/actors", max_restarts=10)
    sup.start()
    while training:
        sup.poll()          # restarts what crashed
    sup.stop()
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import signal
import subprocess
import sys
import time
from typing import Dict, List, Mapping, Optional, Sequence

__all__ = ["ActorSupervisor", "ActorProcess", "actor_process_commands", "DIVERGED_EXIT_CODE", "FINISHED_EXIT_CODE",
           "SUPERVISED_ENV"]

# An actor process's exit status when its policy's outputs came out NaN or infinite with the
# learner's parameters (actors.actor.PolicyDivergedError): restarting it would only repeat that.
DIVERGED_EXIT_CODE = 4
# A supervised actor process's exit status when the learner said its run is over
# (actors.client.LearnerFinishedError); on its own such a process exits 0. Not restarted.
FINISHED_EXIT_CODE = 5
# Set in the environment of the processes a supervisor starts, so they exit FINISHED_EXIT_CODE.
SUPERVISED_ENV = "IMPALA_REP_SUPERVISED"


def actor_process_commands(
    address: str,
    envs_per_process: Sequence[int],
    seed: int,
    id_prefix: str = "actor",
    nice: int = 0,
    tls_ca: Optional[str] = None,
    give_up_after: Optional[float] = None,
    unrolls_per_message: Optional[int] = None,
    param_prefetch_steps: Optional[int] = None,
) -> List[List[str]]:
    """The ``python -m actors.run`` command of each actor process: process ``i`` hosts
    ``envs_per_process[i]`` envs, is called ``{id_prefix}-{i}`` and seeds them from
    ``seed + 1000 * (i + 1)``. Each child lowers its own priority by ``nice`` (and its session
    group's: the supervisor starts it in a session of its own). The token travels in the
    environment (``IMPALA_REP_TOKEN``), never on the command line, where ps would show it."""
    commands = []
    for i, n in enumerate(envs_per_process):
        cmd = [sys.executable, "-m", "actors.run", "--learner-address", address, "--actors", str(n),
               "--actor-processes", "1", "--actor-id", f"{id_prefix}-{i}", "--seed", str(seed + 1000 * (i + 1)),
               "--nice", str(nice)]
        if give_up_after is not None:
            cmd += ["--give-up-after", str(give_up_after)]
        if tls_ca:
            cmd += ["--tls-ca", tls_ca]
        if unrolls_per_message is not None:
            cmd += ["--unrolls-per-message", str(unrolls_per_message)]
        if param_prefetch_steps is not None:
            cmd += ["--param-prefetch-steps", str(param_prefetch_steps)]
        commands.append(cmd)
    return commands

log = logging.getLogger(__name__)

# An actor process that ran this long before it stopped starts its count of restarts again:
# --max-actor-restarts bounds a crash loop, not the rare crashes of a run that lasts days.
RESTART_WINDOW_S = 600.0


@dataclasses.dataclass
class ActorProcess:
    index: int
    command: List[str]
    log_path: Optional[str]
    process: Optional[subprocess.Popen] = None
    restarts: int = 0  # since it last ran RESTART_WINDOW_S without stopping
    restarts_total: int = 0
    given_up: bool = False
    finished: bool = False  # exited FINISHED_EXIT_CODE: the learner's run is over
    started_at: float = 0.0


def _tail(path: Optional[str], lines: int = 5) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4096))
        text = f.read().decode("utf-8", "replace")
    return "\n".join(text.strip().splitlines()[-lines:])


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


class ActorSupervisor:
    """Keeps ``len(commands)`` actor processes running."""

    def __init__(
        self,
        commands: Sequence[Sequence[str]],
        log_dir: Optional[str] = None,
        max_restarts: int = 10,
        env: Optional[Mapping[str, str]] = None,
    ):
        if max_restarts < 0:
            raise ValueError(f"max_restarts must be 0 or more, got {max_restarts}.")
        self._log_dir = log_dir
        self._max_restarts = int(max_restarts)
        self._env = dict(os.environ if env is None else env)
        self._env[SUPERVISED_ENV] = "1"
        self._stopping = False
        # The first diverged actor's report (DIVERGED_EXIT_CODE), a clause: "actor process i's
        # policy gave NaN or infinite log-probabilities with parameters version N".
        self.diverged: Optional[str] = None
        self.diverged_version: Optional[int] = None  # the parameters version it names, when the log said
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
        self.actors = [
            ActorProcess(i, list(cmd), os.path.join(log_dir, f"actor-{i}.log") if log_dir else None)
            for i, cmd in enumerate(commands)
        ]

    def _spawn(self, actor: ActorProcess) -> None:
        # Without a log file the child writes where this process does: its reasons (a refused
        # token, a TLS mistake, an env the learner's spec does not match) are never discarded.
        out = open(actor.log_path, "ab") if actor.log_path else None
        try:
            actor.process = subprocess.Popen(
                actor.command, stdout=out, stderr=subprocess.STDOUT if out else None, env=self._env,
                start_new_session=True,
            )
        finally:
            if actor.log_path:
                out.close()
        actor.started_at = time.monotonic()

    def start(self) -> None:
        for actor in self.actors:
            self._spawn(actor)
        log.info("started %d actor process(es)", len(self.actors))

    @property
    def alive(self) -> int:
        return sum(1 for a in self.actors if a.process is not None and a.process.poll() is None)

    @property
    def total_restarts(self) -> int:
        return sum(a.restarts_total for a in self.actors)

    @property
    def all_given_up(self) -> bool:
        return all(a.given_up for a in self.actors)

    @property
    def all_finished(self) -> bool:
        """Every actor process stopped because the learner said its run is over."""
        return all(a.finished for a in self.actors)

    @property
    def all_done(self) -> bool:
        """No actor process runs any more or will be restarted (finished or given up)."""
        return all(a.finished or a.given_up for a in self.actors)

    def poll(self) -> List[str]:
        """Restarts crashed actors; returns one sentence per event (also logged)."""
        events = []
        if self._stopping:
            return events
        for actor in self.actors:
            if actor.given_up or actor.finished or actor.process is None:
                continue
            code = actor.process.poll()
            if code is None:
                continue
            reason = describe_exit(code)
            if time.monotonic() - actor.started_at >= RESTART_WINDOW_S:
                actor.restarts = 0  # it ran a good while: a new crash, not the same loop
            tail = _tail(actor.log_path)
            detail = f"; last output:\n{tail}" if tail else ""
            if code == FINISHED_EXIT_CODE:
                actor.finished = True
                msg = f"actor process {actor.index} stopped: the learner's run is over"
                log.info(msg)
            elif code == DIVERGED_EXIT_CODE:
                actor.given_up = True
                if self.diverged is None:
                    version = re.search(r"parameters version (\d+)", tail)
                    self.diverged_version = int(version.group(1)) if version else None
                    self.diverged = (
                        f"actor process {actor.index}'s policy gave NaN or infinite log-probabilities with "
                        + (f"parameters version {version.group(1)}" if version else "the learner's parameters")
                    )
                msg = f"actor process {actor.index} stopped: the training run diverged; not restarting it{detail}"
                log.error(msg)
            elif actor.restarts >= self._max_restarts:
                actor.given_up = True
                msg = (
                    f"actor process {actor.index} {reason} and has been restarted {actor.restarts} times, each run "
                    f"shorter than {RESTART_WINDOW_S:.0f} s (--max-actor-restarts {self._max_restarts}); not "
                    f"restarting it again{detail}"
                )
                log.error(msg)
            else:
                actor.restarts += 1
                actor.restarts_total += 1
                msg = f"actor process {actor.index} {reason}; restarting it ({actor.restarts}/{self._max_restarts}){detail}"
                log.warning(msg)
                self._spawn(actor)
            events.append(msg)
        return events

    def pids(self) -> Dict[int, int]:
        return {a.index: a.process.pid for a in self.actors if a.process is not None and a.process.poll() is None}

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every actor, then SIGKILL what is left after ``timeout`` seconds."""
        self._stopping = True
        procs = [a.process for a in self.actors if a.process is not None and a.process.poll() is None]
        for p in procs:
            try:
                p.terminate()
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
