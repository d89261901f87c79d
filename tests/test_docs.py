"""The figures the README and docs/BENCHMARKS.md derive by hand, recomputed from what they rest on.

Each session adds benchmark runs and seed pairs and updates the counts, means and tests by hand;
these tests fail when a derived figure no longer follows from its data: the throughput tallies
from the stored benchmark JSONs, and the seed-pair summaries from the pair rows above them.
"""

import itertools
import math
import re
import statistics
from pathlib import Path

import pytest
from script_modules import load as load_script

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_the_throughput_tallies_are_the_stored_runs_tallies():
    # The README's table counts the runs at 0.85 per host kind (docs/benchmarks/hosts.txt) and
    # since the forty-seventh session, and BENCHMARKS.md's newest section the latter;
    # scripts/benchmark_tally.py counts the stored JSONs.
    tally = load_script("benchmark_tally")
    root = ROOT / "docs" / "benchmarks"
    runs = tally.collect(root, since=47)
    hosts = tally.read_hosts(root)
    counted = tally.tally(runs, target=0.85)
    synthetic, cartpole = counted["synthetic"], counted["dmc/cartpole-swingup"]
    header = "| host kind (`--host`), sessions | `synthetic` | `dmc/cartpole-swingup` |"
    assert header in README, "the README's throughput table is not where this test looks"
    rows = re.findall(r"^\| (.*?) \| (.*?) \| (.*?) \|$", README.split(header, 1)[1].split("\n\n", 1)[0], re.M)
    seen = set()
    for label, *cells in rows:
        found = re.fullmatch(r".*\(`(\w+)`\), sessions ([\d, -]+)", label)
        if found:
            kind = found[1]
            seen.add(kind)
            # The sessions the row names are hosts.txt's for that kind (those since the 47th).
            named = [session for part in found[2].split(",") for session in tally.session_range(part.strip())]
            assert named == sorted(s for s, h in hosts.items() if h["kind"] == kind and s >= 47), label
            entries = tally.tally([run for run in runs if run["host"] == kind], target=0.85)
        else:
            assert label == "every run since session 47", label
            entries = counted
        for workload, cell in zip(("synthetic", "dmc/cartpole-swingup"), cells):
            found = re.match(r"(0\.\d{3})-(0\.\d{3}), mean (0\.\d{3}); at or past 0\.85 in (\d+) of (\d+) runs", cell)
            assert found, f"the README's throughput cell {cell!r} is not in the form this test reads"
            entry = entries[workload]
            assert (float(found[1]), float(found[2]), float(found[3]), int(found[4]), int(found[5])) == (
                entry["lowest"]["ratio"], entry["highest"]["ratio"], entry["mean"], entry["met"], entry["runs"]), (label, cell)
    assert seen == {run["host"] for run in runs}, "the README's table leaves out a host kind with stored runs"
    # Each benchmark section ends with the tally after its runs; the latest counts the most runs.
    sentences = re.findall(r"Tallies\s+since\s+the\s+forty-seventh\s+session:\s+synthetic\s+at\s+or\s+past\s+0\.85\s+in\s+"
                           r"(\d+)\s+of\s+(\d+)\s+runs,\s+cartpole\s+in\s+(\d+)\s+of\s+(\d+)", (ROOT / "docs" / "BENCHMARKS.md").read_text())
    assert sentences, "docs/BENCHMARKS.md has no tally sentence where this test looks"
    latest = max((tuple(map(int, found)) for found in sentences), key=lambda t: (t[1], t[3]))
    assert latest == (synthetic["met"], synthetic["runs"], cartpole["met"], cartpole["runs"])


# ----------------------------------------------------------------------------- seed pairs


def _signed_ranks(differences):
    """Mid-ranks of the differences' sizes; zero differences are an error, not dropped."""
    if any(d == 0 for d in differences):
        raise ValueError("a zero difference has no sign")
    sizes = sorted(abs(d) for d in differences)
    return [statistics.fmean(i + 1 for i, s in enumerate(sizes) if s == abs(d)) for d in differences]


def _share_at_most(ranks, observed):
    """The share of the 2^n sign patterns whose negative rank sum is at most ``observed``."""
    at_most = sum(1 for signs in itertools.product((0, 1), repeat=len(ranks))
                  if sum(r for r, s in zip(ranks, signs) if s) <= observed + 1e-9)
    return at_most / 2 ** len(ranks)


def wilcoxon_two_sided(differences):
    """Exact two-sided p of the Wilcoxon signed-rank test, by enumerating every sign pattern."""
    ranks = _signed_ranks(differences)
    negative = sum(r for r, d in zip(ranks, differences) if d < 0)
    return min(1.0, 2 * _share_at_most(ranks, min(negative, sum(ranks) - negative)))


def wilcoxon_one_sided_greater(differences):
    """Exact one-sided p of the Wilcoxon signed-rank test for differences above zero."""
    ranks = _signed_ranks(differences)
    return _share_at_most(ranks, sum(r for r, d in zip(ranks, differences) if d < 0))


def test_wilcoxon_matches_the_tables_of_the_exact_test():
    # n = 8 with one negative of rank 1: W = 1, P(W <= 1) = 2/256 one-sided.
    assert wilcoxon_two_sided([5, 6, 7, 8, 9, 10, 11, -1]) == pytest.approx(4 / 256)
    # All one sign: the smallest p n allows, 2 / 2^n.
    assert wilcoxon_two_sided([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)
    # Symmetric about zero: p = 1.
    assert wilcoxon_two_sided([1, -1, 2, -2]) == 1.0
    with pytest.raises(ValueError):
        wilcoxon_two_sided([1, 0, 2])
    # One-sided, for differences above zero: half the two-sided p in the direction seen, near 1
    # against it.
    assert wilcoxon_one_sided_greater([5, 6, 7, 8, 9, 10, 11, -1]) == pytest.approx(2 / 256)
    assert wilcoxon_one_sided_greater([1, 2, 3, 4, 5]) == pytest.approx(1 / 32)
    assert wilcoxon_one_sided_greater([-1, -2, -3]) == 1.0
    assert wilcoxon_one_sided_greater([-5, -6, -7, -8, -9, -10, -11, 1]) == pytest.approx(255 / 256)


def _number(cell):
    # "**896.8 ± 24.8**" -> 896.8; "−8.8" (a minus sign) -> -8.8
    return float(cell.replace("**", "").split("±")[0].replace("−", "-").strip())


def _pair_rows(label, summary_label):
    """The README pair table's rows whose first cell is "LABEL, SEED": (seed, with $F, the default,
    $F ahead by, bold F, bold default); the cells of the row whose first cell fully matches the
    pattern ``summary_label``; and the number of pairs its first group names."""
    rows, summary, count = [], None, None
    for line in README.splitlines():
        if not line.startswith("| "):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if found := re.fullmatch(summary_label, cells[0]):
            summary, count = cells, int(found[1])
        elif found := re.fullmatch(rf"{re.escape(label)}, (\d+)", cells[0]):
            rows.append((int(found[1]), _number(cells[2]), _number(cells[3]), _number(cells[4]),
                         cells[2].startswith("**"), cells[3].startswith("**")))
    return rows, summary, count


def _check_rows_and_means(rows, summary, count):
    """Each row's difference and bold mean follow from its two means, and the summary's count and
    means from the rows."""
    for _, f, d, ahead, f_bold, d_bold in rows:
        assert ahead == pytest.approx(f - d, abs=0.051), (f, d, ahead)
        assert (f_bold, d_bold) == (f > d, d > f), f"the higher 30-episode mean is the bold one: {f}, {d}"
    assert count == len(rows)
    assert _number(summary[2]) == round(statistics.fmean(f for _, f, *_ in rows), 1)
    assert _number(summary[3]) == round(statistics.fmean(d for _, _, d, *_ in rows), 1)


@pytest.mark.parametrize("task", ["walker-walk", "cheetah-run"])
def test_the_seed_pair_summaries_follow_from_the_pair_rows(task):
    rows, summary, count = _pair_rows(task, rf"\*\*{task}, (\d+) pairs\*\*")
    assert len(rows) >= 2 and summary, f"the README's seed-pair table for {task} is not where this test looks"
    _check_rows_and_means(rows, summary, count)
    differences = [ahead for *_, ahead, _, _ in rows]
    stated = re.fullmatch(r"(?:\*\*)?([+−-][\d.]+)(?:\*\*)? \(sd ([\d.]+): t = ([\d.]+), Wilcoxon p = ([\d.]+)\)",
                          summary[4])
    assert stated, summary[4]
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    assert _number(stated[1]) == pytest.approx(round(mean, 1), abs=0.051)
    assert float(stated[2]) == pytest.approx(round(sd, 1), abs=0.051)
    assert float(stated[3]) == pytest.approx(round(mean / (sd / math.sqrt(len(rows))), 2), abs=0.0051)
    p = wilcoxon_two_sided(differences)
    assert float(stated[4]) == round(p, len(stated[4].split(".")[1]))
    # The mean difference is bold only when the signed-rank test clears 0.05.
    assert summary[4].startswith("**") == (p < 0.05)


def test_the_pre_registered_cheetah_batch_follows_from_its_rows():
    # docs/RESULTS.md fixed the batch before its first pair: ten pairs, seeds 16 to 25, and one
    # test, the one-sided signed-rank test, run once after the tenth. Until then the summary row
    # gives the means and no test; after it, the test's p, bold only when it clears 0.05.
    rows, summary, count = _pair_rows("cheetah-run batch", r"\*\*cheetah-run batch, (\d+) of 10 pairs\*\*")
    assert rows and summary, "the README's pre-registered batch table is not where this test looks"
    assert [seed for seed, *_ in rows] == list(range(16, 16 + len(rows))) and len(rows) <= 10
    _check_rows_and_means(rows, summary, count)
    differences = [ahead for *_, ahead, _, _ in rows]
    if len(rows) < 10:
        stated = re.fullmatch(r"([+−-][\d.]+) \(no test until the tenth pair\)", summary[4])
        assert stated, summary[4]
        assert _number(stated[1]) == pytest.approx(round(statistics.fmean(differences), 1), abs=0.051)
    else:
        stated = re.fullmatch(r"(?:\*\*)?([+−-][\d.]+)(?:\*\*)? \(one-sided Wilcoxon p = ([\d.]+)\)", summary[4])
        assert stated, summary[4]
        assert _number(stated[1]) == pytest.approx(round(statistics.fmean(differences), 1), abs=0.051)
        p = wilcoxon_one_sided_greater(differences)
        assert float(stated[2]) == round(p, len(stated[2].split(".")[1]))
        assert summary[4].startswith("**") == (p < 0.05)
