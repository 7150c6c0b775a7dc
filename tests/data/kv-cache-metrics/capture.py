import sys, time, json, threading, urllib.request
sys.path.insert(0, "/work/main"); sys.path.insert(0, "/work/main/lab")
from tests.support.engine import VllmEngine, build_tiny_model
md = build_tiny_model()
def post(url, body):
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r: return json.loads(r.read())
with VllmEngine(md, num_gpu_blocks=96, max_model_len=2048, extra_args=["--kv-cache-metrics", "--kv-cache-metrics-sample", "1.0"]) as eng:
    print("up", eng.url, flush=True)
    open("/tmp/kvm/000-start.prom", "w").write(eng.metrics_text())
    def session(i):
        ctx = " ".join(f"t{(i*37+k)%2000+4}" for k in range(300))
        for turn in range(3):
            out = post(eng.url, {"model": "tiny", "prompt": ctx, "max_tokens": 120, "ignore_eos": True, "temperature": 0})
            ctx += " " + " ".join(f"t{(i*11+k)%2000+4}" for k in range(270))
            time.sleep(1.0)
    ths = [threading.Thread(target=session, args=(i,)) for i in range(6)]
    [t.start() for t in ths]
    n = 1
    while any(t.is_alive() for t in ths):
        time.sleep(5); open(f"/tmp/kvm/{n:03d}.prom", "w").write(eng.metrics_text()); n += 1
    [t.join() for t in ths]
    open("/tmp/kvm/999-end.prom", "w").write(eng.metrics_text())
print("done", flush=True)
