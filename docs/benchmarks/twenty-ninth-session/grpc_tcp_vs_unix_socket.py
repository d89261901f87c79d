# gRPC over TCP loopback against a Unix domain socket: 400 messages of 3.4 MB, one client process;
# CPU per MB at each end (twenty-ninth session). Run: .venv/bin/python THIS_FILE server
import grpc, os, sys, time, resource, threading, subprocess
from concurrent import futures
MSG = 3_400_000; N = 400
def server(addr):
    def stream(it, ctx):
        n = 0
        for m in it: n += len(m)
        return n.to_bytes(8, 'little')
    h = grpc.method_handlers_generic_handler("t.S", {"S": grpc.stream_unary_rpc_method_handler(stream)})
    s = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 64 << 20)])
    s.add_generic_rpc_handlers((h,)); s.add_insecure_port(addr); s.start(); return s
def client(addr):
    ch = grpc.insecure_channel(addr, options=[("grpc.max_send_message_length", 64 << 20)])
    f = ch.stream_unary("/t.S/S")
    payload = os.urandom(MSG)
    t = time.perf_counter(); c0 = time.process_time()
    f(iter([bytes(payload) for _ in range(N)]))
    return time.perf_counter() - t, time.process_time() - c0
if sys.argv[1] == "client":
    w, c = client(sys.argv[2]); print(f"{w} {c}")
else:
    for addr in ["127.0.0.1:50999", "unix:/tmp/uds_test.sock", "127.0.0.1:50998", "unix:/tmp/uds_test2.sock"]:
        s = server(addr)
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        out = subprocess.run([sys.executable, __file__, "client", addr], capture_output=True, text=True).stdout.split()
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        su = (r1.ru_utime - r0.ru_utime); ss = (r1.ru_stime - r0.ru_stime)
        print(f"{addr:28s} wall {float(out[0]):.2f}s client cpu {float(out[1]):.2f}s server user {su:.2f} sys {ss:.2f}  -> per MB: client {1e3*float(out[1])/(N*MSG/1e6):.3f} ms server {1e3*(su+ss)/(N*MSG/1e6):.3f} ms")
        s.stop(0)
