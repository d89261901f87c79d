# The cost of an actor's unroll boundary at 16 envs (twenty-ninth session): the stack over steps, the
# per-env copies, the encoding and the join into 2 messages. Run it with and without
# MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=134217728 (see docs/BENCHMARKS.md).
import numpy as np, time
from impala_rep.wire import encode_unroll_parts, encode_unroll_batch
E,T=16,20
steps=[]
for t in range(T+1):
    steps.append({"observation/pixels": np.random.randint(0,255,(E,84,84,3),np.uint8),
        "step_type": np.zeros(E,np.uint8),"reward":np.zeros(E,np.float32),"discount":np.ones(E,np.float32),
        "action":np.zeros((E,1),np.float32),"behaviour_log_prob":np.zeros(E,np.float32)})
prefix={"pixels":np.random.randint(0,255,(2,E,84,84,3),np.uint8)}
def emit():
    stacked = {k: np.stack([s[k] for s in steps]) for k in steps[0]}
    t1=time.perf_counter()
    outs=[]
    for i in range(E):
        tensors = {k: np.ascontiguousarray(v[:, i]) for k, v in stacked.items()}
        tensors["frame_prefix/pixels"]=np.ascontiguousarray(prefix["pixels"][:, i])
        outs.append(tensors)
    t2=time.perf_counter()
    parts=[encode_unroll_parts("a",1,t) for t in outs]
    t3=time.perf_counter()
    msgs=[encode_unroll_batch(parts[j:j+8]) for j in range(0,E,8)]
    t4=time.perf_counter()
    return t1,t2,t3,t4
N=200
acc=np.zeros(4)
for _ in range(N):
    t0=time.perf_counter(); t1,t2,t3,t4=emit()
    acc+=[t1-t0,t2-t1,t3-t2,t4-t3]
acc/=N
print("ms per emit: stack %.2f contig %.2f parts %.2f join %.2f total %.2f; per agent step us %.1f"%(*(acc*1e3),acc.sum()*1e3, acc.sum()*1e6/(E*T)))
