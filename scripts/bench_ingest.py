#!/usr/bin/env python
"""Ingest rate of the actor -> learner transport over loopback.

A LearnerServer (validation on) runs in this process with a consumer that drains the queue
(``--batch B`` also builds time-major batches with rebuilt frame stacks, as the learner
does); actor clients run in ``--procs`` separate processes, each with several LearnerClient
streams (threads) that encode and send unrolls of 84x84x3 uint8 frames (unroll 20, 3 frames
stacked on the learner, so 21 + 2 frames travel per unroll), ``--per-message`` of them per
message (1: one ``Unroll`` per message; the actors' default, 8, packs up to 8 into one
``UnrollBatch``, as ``LearnerClient.send_many`` does). For each client count the rate is
measured over ``--seconds`` after a warm-up.

frames/s counts env steps (T = 20 per unroll); MB/s counts serialized unroll bytes;
server_cpu_us_per_unroll is the CPU time of the server process (gRPC, parsing, validation
and the consumer) per accepted unroll, less sensitive than rates to a busy machine.

    .venv/bin/python scripts/bench_ingest.py --clients 1 8 64 --seconds 5 --json
    .venv/bin/python scripts/bench_ingest.py --clients 32 --procs 2 --seconds 10 --batch 32 --per-message 8
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import threading
import time


def _client_process(address, n_streams, first_id, t_stop, unroll_length, size, ready, per_message=1):
    import numpy as np

    from actors.client import LearnerClient

    def stream(i):
        client = LearnerClient(address, actor_id=f"bench-{first_id + i}", give_up_after_s=30,
                               unrolls_per_message=per_message)
        hs = client.connect()
        rng = np.random.default_rng(first_id + i)
        unroll = {}
        for key, spec in hs.unroll_spec.items():
            if spec.dtype == "uint8" and key != "step_type":
                unroll[key] = rng.integers(0, 256, spec.shape, dtype=np.uint8)
            elif spec.num_values is not None:
                unroll[key] = rng.integers(0, spec.num_values, spec.shape).astype(spec.dtype)
            else:
                unroll[key] = np.zeros(spec.shape, spec.dtype)
        unroll["step_type"][:] = 1
        unroll["discount"][:] = 1.0
        ready.put(1)
        items = [(unroll, 0, (), ())] * per_message
        while time.time() < t_stop:
            try:
                # With unrolls_per_message=1 send_many sends each unroll as send() does.
                client.send_many(items, timeout=max(0.05, t_stop - time.time()))
            except TimeoutError:
                break
        client.close(drain=False, timeout=2)

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(n_streams)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def _cpu_seconds():
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run_setting(n_clients, procs, seconds, warmup, batch, unroll_length=20, size=84, per_message=1):
    from impala_rep.specs import ArraySpec, EnvSpec, unroll_spec
    from learner.batcher import Batcher
    from learner.params import ParameterStore
    from learner.queue import QueueClosed, UnrollQueue
    from learner.server import LearnerServer

    env = EnvSpec({"pixels": ArraySpec("pixels", (size, size, 3), "uint8")},
                  ArraySpec("action", (), "int32", num_values=6))
    spec = unroll_spec(env, unroll_length, frame_stack={"pixels": 3})
    q = UnrollQueue(capacity=256)
    server = LearnerServer(spec, unroll_length, q, ParameterStore(), frame_stack={"pixels": 3},
                           max_streams=max(64, n_clients) + 8)
    server.start()
    stop = threading.Event()
    batches = [0]

    def consume():
        batcher = Batcher(q, spec, batch_size=batch, frame_stack={"pixels": 3}) if batch else None
        while not stop.is_set():
            try:
                if batcher is not None:
                    batcher.next_batch(timeout=0.1)
                    batches[0] += 1
                else:
                    q.get_many(min(len(q), 32) or 1, timeout=0.1)
            except (TimeoutError, QueueClosed):
                pass

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    procs = max(1, min(procs, n_clients))
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    t_stop = time.time() + warmup + seconds + 30  # generous; we stop them after measuring
    per = [n_clients // procs + (1 if i < n_clients % procs else 0) for i in range(procs)]
    workers, first = [], 0
    for n in per:
        p = ctx.Process(target=_client_process,
                        args=(server.address, n, first, t_stop, unroll_length, size, ready, per_message), daemon=True)
        p.start()
        workers.append(p)
        first += n
    for _ in range(n_clients):
        ready.get(timeout=120)
    time.sleep(warmup)
    m0, t0, b0, c0 = server.metrics.snapshot(), time.monotonic(), batches[0], _cpu_seconds()
    time.sleep(seconds)
    m1, t1, b1, c1 = server.metrics.snapshot(), time.monotonic(), batches[0], _cpu_seconds()
    for p in workers:
        p.terminate()
    for p in workers:
        p.join(10)
    stop.set()
    consumer.join(5)
    server.stop(0)
    dt = t1 - t0
    unrolls = m1["unrolls_accepted"] - m0["unrolls_accepted"]
    messages = m1["messages_accepted"] - m0["messages_accepted"]
    frames = m1["frames_accepted"] - m0["frames_accepted"]
    nbytes = m1["bytes_accepted"] - m0["bytes_accepted"]
    return {
        "clients": n_clients,
        "processes": procs,
        "unrolls_per_message": per_message,
        "unrolls_per_message_received": round(unrolls / messages, 2) if messages else None,
        "seconds": round(dt, 2),
        "unrolls_per_s": round(unrolls / dt, 1),
        "frames_per_s": round(frames / dt, 1),
        "frames_on_wire_per_s": round(unrolls * (unroll_length + 1 + 2) / dt, 1),
        "megabytes_per_s": round(nbytes / dt / 1e6, 1),
        "rejected": m1["unrolls_rejected"],
        "batches_per_s": round((b1 - b0) / dt, 2) if batch else None,
        # CPU time of this (the learner's) process: gRPC, parsing, validation, the consumer.
        "server_cpu_cores": round((c1 - c0) / dt, 2),
        "server_cpu_us_per_unroll": round((c1 - c0) / unrolls * 1e6, 1) if unrolls else None,
        "queue_fill_end": round(q.fill, 2),
    }


def main(argv=None):
    from impala_rep.flags import int_at_least, nonnegative_float, positive_float

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int_at_least(1, "a positive number of clients"), nargs="+", default=[1, 8, 64])
    parser.add_argument("--procs", type=int_at_least(1, "a positive number of processes"), default=4, help="client processes (at most one per client)")
    parser.add_argument("--seconds", type=positive_float, default=5.0, help="measured time per setting (bounded)")
    parser.add_argument("--warmup", type=nonnegative_float, default=1.5)
    parser.add_argument("--batch", type=int_at_least(0, "a batch size (0: none)"), default=0, help="also build learner batches of this size (0: just drain)")
    parser.add_argument("--per-message", type=int_at_least(1, "a positive number of unrolls per message"), default=1,
                        help="unrolls per message (1: one Unroll each; above 1: UnrollBatch messages of up to this "
                             "many, as the actors send with their default of 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.seconds > 120:
        parser.error("--seconds must be in (0, 120].")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = [run_setting(n, args.procs, args.seconds, args.warmup, args.batch, per_message=args.per_message)
               for n in args.clients]
    report = {"cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "results": results}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"{'clients':>7} {'procs':>5} {'frames/s':>10} {'MB/s':>8} {'unrolls/s':>9} {'batches/s':>9} "
              f"{'server us/unroll':>16}")
        for r in results:
            print(f"{r['clients']:>7} {r['processes']:>5} {r['frames_per_s']:>10.0f} {r['megabytes_per_s']:>8.1f} "
                  f"{r['unrolls_per_s']:>9.1f} {r['batches_per_s'] if r['batches_per_s'] is not None else '-':>9} "
                  f"{r['server_cpu_us_per_unroll'] if r['server_cpu_us_per_unroll'] is not None else '-':>16}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
