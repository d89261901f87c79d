#!/usr/bin/env python
"""Tally the stored benchmark runs: how often each workload met the ratio target.

Reads every ``scripts/benchmark.py --json`` output kept under ``docs/benchmarks/`` (one folder
per session, named ``ninety-second-session`` and so on), takes the sessions from ``--since``
on, leaves out the files that ``docs/benchmarks/not-counted.txt`` names (runs measuring
something else: a learner slowed on purpose, a build before the change the tally starts at),
and prints per workload the number of runs, how many reached ``--target`` of the ceiling,
and the lowest and highest ratio with the session of each. ``docs/benchmarks/hosts.txt``
names each session's host kind: ``--host KIND`` counts one kind's runs, and a run that records
its CPU family and model must match its session's line. The README's and
``docs/BENCHMARKS.md``'s tallies are this script's output; the test suite checks them.

Usage::

    python scripts/benchmark_tally.py                 # since the forty-seventh session
    python scripts/benchmark_tally.py --since 85 --until 92 --json
    python scripts/benchmark_tally.py --host zen4     # one host kind's runs
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_UNITS = ("first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth "
          "thirteenth fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth").split()
_TENS = {"twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
         "eighty": 80, "ninety": 90}
_TENS_ORDINAL = {"twentieth": 20, "thirtieth": 30, "fortieth": 40, "fiftieth": 50,
                 "sixtieth": 60, "seventieth": 70, "eightieth": 80, "ninetieth": 90}
NOT_COUNTED = "not-counted.txt"
HOSTS = "hosts.txt"


def _ordinal(words: str) -> int | None:
    """1 to 99 from an ordinal such as ``ninety-second``, or None for anything else."""
    if words in _UNITS:
        return _UNITS.index(words) + 1
    if words in _TENS_ORDINAL:
        return _TENS_ORDINAL[words]
    tens, _, unit = words.partition("-")
    if tens in _TENS and unit in _UNITS[:9]:
        return _TENS[tens] + _UNITS.index(unit) + 1
    return None


def session_number(folder: str) -> int | None:
    """The session a folder such as ``ninety-second-session``, ``hundredth-session`` or
    ``hundred-and-first-session`` holds (up to the 199th), or None for another name."""
    if not folder.endswith("-session"):
        return None
    words = folder[: -len("-session")].removeprefix("one-")
    if words == "hundredth":
        return 100
    for prefix in ("hundred-and-", "hundred-"):
        if words.startswith(prefix):
            rest = _ordinal(words[len(prefix):])
            return None if rest is None else 100 + rest
    return _ordinal(words)


def read_not_counted(root: Path) -> dict[str, str]:
    """``{relative path: reason}`` from the root's not-counted list (``path  reason`` lines)."""
    path = root / NOT_COUNTED
    if not path.exists():
        return {}
    entries = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, _, reason = line.partition(" ")
        if not reason.strip():
            raise ValueError(f"{path}, line {number}: give the reason the run is not counted "
                             f"after its path ('{name}  <reason>').")
        if not (root / name).is_file():
            raise ValueError(f"{path}, line {number}: {name} is not a file under {root}; "
                             "fix the path or remove the line.")
        entries[name] = reason.strip()
    return entries


def session_range(text: str) -> range | None:
    """The sessions ``47`` or ``47-51`` names, or None for anything else (a range must not run
    backwards)."""
    first, dash, last = text.partition("-")
    if not first.isdigit() or (dash and not last.isdigit()):
        return None
    sessions = range(int(first), int(last or first) + 1)
    return sessions or None


def read_hosts(root: Path) -> dict[int, dict]:
    """``{session: {kind, family, model, description}}`` from the root's hosts list
    (``SESSIONS KIND FAMILY MODEL description`` lines, SESSIONS one number or FIRST-LAST)."""
    path = root / HOSTS
    if not path.exists():
        return {}
    hosts: dict[int, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split(None, 4)
        sessions = session_range(fields[0])
        if len(fields) < 5 or sessions is None or not fields[2].isdigit() or not fields[3].isdigit():
            raise ValueError(f"{path}, line {number}: write 'SESSIONS KIND FAMILY MODEL description', "
                             "SESSIONS one session or FIRST-LAST, FAMILY and MODEL numbers "
                             f"(e.g. '78-84  zen4  25  17  AMD EPYC, Zen 4'), not {line!r}.")
        for session in sessions:
            if session in hosts:
                raise ValueError(f"{path}, line {number}: session {session} already has a host "
                                 f"({hosts[session]['kind']}); give each session one line.")
            hosts[session] = {"kind": fields[1], "family": int(fields[2]), "model": int(fields[3]),
                              "description": fields[4]}
    return hosts


def _check_host(path: Path, data: dict, host: dict | None, session: int, hosts_path: Path) -> None:
    """A run that records its CPU family and model must be on its session's listed host kind."""
    machine = data.get("machine") if isinstance(data.get("machine"), dict) else {}
    recorded = (machine.get("cpu_family"), machine.get("cpu_model"))
    if None in recorded:
        return  # written before scripts/benchmark.py recorded them
    if host is None:
        raise ValueError(f"{path} ran on CPU family {recorded[0]} model {recorded[1]}, and session "
                         f"{session} has no line in {hosts_path}; add one naming its host kind.")
    if recorded != (host["family"], host["model"]):
        raise ValueError(f"{path} ran on CPU family {recorded[0]} model {recorded[1]}, but {hosts_path} "
                         f"gives session {session} the {host['kind']} host (family {host['family']} "
                         f"model {host['model']}); correct the line for session {session}.")


def collect(root: Path, since: int, until: int | None = None, host: str | None = None) -> list[dict]:
    """Every counted run's ratio: ``{session, file, workload, ratio, host}``, oldest session
    first; with ``host``, only the runs of sessions ``hosts.txt`` gives that host kind."""
    skip = read_not_counted(root)
    hosts = read_hosts(root)
    kinds = {entry["kind"] for entry in hosts.values()}
    if host is not None and host not in kinds:
        known = ", ".join(sorted(kinds)) or "none"
        raise ValueError(f"no session in {root / HOSTS} ran on a host kind named {host!r}; "
                         f"the kinds there: {known}.")
    runs = []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        number = session_number(folder.name)
        if number is None and folder.name.endswith("-session"):
            raise ValueError(f"{folder} is named like a session's folder, but its name is not a "
                             "session number the tally reads (e.g. 'ninety-second-session', "
                             "'hundredth-session', 'hundred-and-first-session'); rename it.")
        if number is None or number < since or (until is not None and number > until):
            continue
        for path in sorted(folder.glob("*.json")):
            name = f"{folder.name}/{path.name}"
            if name in skip:
                continue
            try:
                data = json.loads(path.read_text())
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} is not valid JSON ({error}); restore it from git or "
                                 f"list it in {root / NOT_COUNTED}.") from None
            if not isinstance(data, dict) or not isinstance(data.get("results"), list):
                continue  # another script's output (a launcher run, a GPU piece), not a benchmark
            entry = hosts.get(number)
            _check_host(path, data, entry, number, root / HOSTS)
            kind = entry["kind"] if entry else None
            if host is not None and kind != host:
                continue
            for result in data["results"]:
                if "ratio_to_ceiling" in result:
                    runs.append({"session": number, "file": name, "workload": result["workload"],
                                 "ratio": float(result["ratio_to_ceiling"]), "host": kind})
    runs.sort(key=lambda run: (run["session"], run["file"]))
    return runs


def tally(runs: list[dict], target: float) -> dict[str, dict]:
    """Per workload: runs, runs at or past the target (ratios rounded to 3 places, as
    printed), the mean ratio, and the lowest and highest ratio with their sessions."""
    by_workload: dict[str, list[dict]] = {}
    for run in runs:
        by_workload.setdefault(run["workload"], []).append(
            {"ratio": round(run["ratio"], 3), "session": run["session"], "file": run["file"]})
    # min and max keep the first of equal ratios, the oldest (runs come oldest first).
    return {workload: {"runs": len(entries), "met": sum(e["ratio"] >= target for e in entries),
                       "mean": round(sum(e["ratio"] for e in entries) / len(entries), 3),
                       "lowest": min(entries, key=lambda e: e["ratio"]),
                       "highest": max(entries, key=lambda e: e["ratio"])}
            for workload, entries in by_workload.items()}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent
                        / "docs" / "benchmarks", help="the folder of session folders")
    parser.add_argument("--since", type=int, default=47,
                        help="the first session counted (default 47: the learner change)")
    parser.add_argument("--until", type=int, default=None, help="the last session counted")
    parser.add_argument("--target", type=float, default=0.85,
                        help="the ratio to the ceiling a run must reach (default 0.85)")
    parser.add_argument("--host", default=None, metavar="KIND",
                        help="count only the sessions docs/benchmarks/hosts.txt gives this host kind "
                             "(zen4, model167, ...)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        parser.error(f"--root {args.root} is not a folder; pass the folder that holds the "
                     "session folders (docs/benchmarks).")
    if args.since < 1 or (args.until is not None and args.until < args.since):
        parser.error(f"--since {args.since} and --until {args.until} give no sessions; "
                     "--since is at least 1 and --until at least --since.")
    if not 0 < args.target <= 1:
        parser.error(f"--target {args.target} is a ratio to the ceiling; give one in (0, 1].")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        runs = collect(args.root, args.since, args.until, host=args.host)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    result = tally(runs, args.target)
    if args.json:
        print(json.dumps({"since": args.since, "until": args.until, "host": args.host,
                          "target": args.target, "workloads": result}, indent=2))
        return 0
    span = f"sessions {args.since}-{args.until}" if args.until else f"since session {args.since}"
    if args.host:
        span += f" on the {args.host} host"
    if not result:
        print(f"no benchmark runs stored {span} under {args.root}")
        return 0
    for workload, entry in result.items():
        low, high = entry["lowest"], entry["highest"]
        print(f"{workload}: at or past {args.target:g} in {entry['met']} of {entry['runs']} runs "
              f"{span}; {low['ratio']:.3f} (session {low['session']}) to {high['ratio']:.3f} "
              f"(session {high['session']}), mean {entry['mean']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
