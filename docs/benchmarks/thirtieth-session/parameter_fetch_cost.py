"""CPU of one full GetParameters reply (2.7 MB: a shallow network's size at 84x84) on both ends.

A LearnerServer with a ParameterStore runs in this process; a LearnerClient in a subprocess
fetches N times as if holding nothing, then N times up to date. Run from the repo root:
    .venv/bin/python docs/benchmarks/thirtieth-session/parameter_fetch_cost.py
with MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728 in front for glibc's
freed memory kept mapped; COPTS/SOPTS: JSON lists of extra client/server gRPC options.
The server's figure divides all its CPU (2N+10 calls) by N."""
import sys, time, os, resource, subprocess
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts")]
import numpy as np

def cpu():
    u = resource.getrusage(resource.RUSAGE_SELF); return u.ru_utime + u.ru_stime

if len(sys.argv) > 1 and sys.argv[1] == "client":
    import json, grpc
    extra = json.loads(os.environ.get("COPTS", "[]"))
    orig = grpc.insecure_channel
    grpc.insecure_channel = lambda a, o=None, *r, **k: orig(a, list(o or []) + [tuple(x) for x in extra], *r, **k)
    from actors.client import LearnerClient
    c = LearnerClient(sys.argv[2], actor_id="x", give_up_after_s=30)
    c.connect()
    n = int(sys.argv[3])
    for _ in range(5):
        c._have_version = 0; c.get_parameters()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0, t0 = cpu(), time.time()
    for _ in range(n):
        c._have_version = 0
        v, p = c.get_parameters()
    c1, t1 = cpu(), time.time()
    print("faults per fetch", (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / n)
    # small fetches (up to date)
    c2 = cpu()
    for _ in range(n):
        c.get_parameters()
    c3 = cpu()
    print(f"client full fetch cpu ms {(c1-c0)/n*1e3:.2f} wall {(t1-t0)/n*1e3:.2f}; up-to-date {(c3-c2)/n*1e3:.3f}", flush=True)
    sys.exit(0)

from impala_rep.specs import ArraySpec, EnvSpec, unroll_spec
from learner.params import ParameterStore
from learner.queue import UnrollQueue
from learner.server import LearnerServer
env = EnvSpec({"pixels": ArraySpec("pixels", (84, 84, 3), "uint8")}, ArraySpec("action", (), "int32", num_values=6))
spec = unroll_spec(env, 20, frame_stack={"pixels": 3})
store = ParameterStore()
rng = np.random.default_rng(0)
store.publish({"a": rng.standard_normal((2592, 256)).astype(np.float32), "b": rng.standard_normal((8,8,9,16)).astype(np.float32), "c": rng.standard_normal((4,4,16,32)).astype(np.float32)})
import json
server = LearnerServer(spec, 20, UnrollQueue(capacity=16), store, frame_stack={"pixels": 3}, grpc_options=[tuple(x) for x in json.loads(os.environ.get("SOPTS", "[]"))])
server.start()
n = 200
c0 = cpu()
out = subprocess.run([sys.executable, __file__, "client", server.address, str(n)], capture_output=True, text=True)
c1 = cpu()
print(out.stdout, out.stderr[-2000:])
print(f"server cpu ms per fetch (incl. small ones, 2n+10 calls): {(c1-c0)/n*1e3:.2f}")
server.stop(0)
