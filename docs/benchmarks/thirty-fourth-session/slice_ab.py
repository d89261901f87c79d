"""Live synthetic launcher run; alternating windows with per-task EEVDF slices (sched_attr.sched_runtime) set on the
actor processes' / learner's threads (thirty-fourth session). Env: ACTOR_SLICE_MS, LEARNER_SLICE_MS (0 = leave
default), WARM, WIN, ROUNDS. Extra arguments go to the launcher (e.g. --env dmc/cartpole-swingup)."""
import collections, ctypes, glob, os, sys, time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "thirty-third-session"))
from thread_cpu import last_record, launcher_pids, sample, start_launcher, stop  # noqa: E402

WARM, WIN, ROUNDS = float(os.environ.get("WARM", 30)), float(os.environ.get("WIN", 20)), int(os.environ.get("ROUNDS", 3))
SLICE_MS = {"actor": float(os.environ.get("ACTOR_SLICE_MS", 0)), "learner": float(os.environ.get("LEARNER_SLICE_MS", 0))}
libc = ctypes.CDLL(None, use_errno=True)


class Attr(ctypes.Structure):
    _fields_ = [("size", ctypes.c_uint32), ("policy", ctypes.c_uint32), ("flags", ctypes.c_uint64), ("nice", ctypes.c_int32),
                ("prio", ctypes.c_uint32), ("runtime", ctypes.c_uint64), ("deadline", ctypes.c_uint64), ("period", ctypes.c_uint64),
                ("umin", ctypes.c_uint32), ("umax", ctypes.c_uint32)]


def set_slice(tid, ms):
    """The thread's requested slice in ms (0: the kernel's default), its policy and nice kept."""
    a = Attr()
    a.size = ctypes.sizeof(Attr)
    if libc.syscall(315, tid, ctypes.byref(a), ctypes.sizeof(Attr), 0) != 0:  # sched_getattr
        return False
    a.runtime, a.flags = int(ms * 1e6), 0
    if libc.syscall(314, tid, ctypes.byref(a), 0) != 0:  # sched_setattr
        print("setattr", tid, ctypes.get_errno())
        return False
    return True


def group(role):
    return "learner" if role == "learner" else "actor"


def apply(p, on):
    for pid, role in launcher_pids(p).items():
        ms = SLICE_MS[group(role)]
        if ms:
            for t in glob.glob(f"/proc/{pid}/task/*"):
                set_slice(int(t.rsplit("/", 1)[1]), ms if on else 0)


def involuntary(p):
    counts = collections.Counter()
    for (role, *_), (_, _, invol) in sample(p).items():
        counts[group(role)] += invol
    return counts


p, mf = start_launcher(sys.argv[1:])
try:
    time.sleep(WARM)
    res = collections.defaultdict(list)
    for r in range(ROUNDS):
        for on in (False, True):
            apply(p, on)
            time.sleep(2)
            a, c0 = last_record(mf), involuntary(p)
            time.sleep(WIN)
            b, c1 = last_record(mf), involuntary(p)
            rate = (b["agent_steps"] - a["agent_steps"]) / (b["time"] - a["time"])
            res[on].append(rate)
            print(f"round {r} slice {'on ' if on else 'off'} {rate:7.0f} agent steps/s  invol/s actor "
                  f"{(c1['actor']-c0['actor'])/WIN:5.0f} learner {(c1['learner']-c0['learner'])/WIN:5.0f}", flush=True)
    for on in (False, True):
        print("on" if on else "off", " ".join(f"{x:.0f}" for x in res[on]), f"mean {sum(res[on])/len(res[on]):.0f}")
finally:
    stop(p)
