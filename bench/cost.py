#!/usr/bin/env python3
"""What one request costs the server: a light model driven at a fixed offered rate below
saturation, over HTTP with the binary extension, HTTP with JSON and gRPC, with dynamic batching
on and off. The server's CPU time (user + system, every thread, from /proc/<pid>/stat) over the
window, divided by the requests it answered in it (its own statistics), is the cost of a request.

With --profile, perf samples the server during each window and the top entries of the flat
profile go beside the figures.

Usage: bash bench/cost.sh [--before OTHER_BUILD] [--profile]; or, with the reference repositories built:
  python bench/cost.py --on bench/.work/ref/model_repository --off bench/.work/ref_nobatch/model_repository
"""
import argparse
import json
import os
import subprocess
import sys
import threading
import time
import re
import socket
import statistics

import numpy as np

import run

TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """User plus system CPU of every thread of the process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def switches(pid):
    """Context switches (voluntary and not) of every thread of the process so far: each is a thread
    put to sleep or pre-empted, and on a virtual machine each costs more than a small request's work."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                total += sum(int(l.split()[1]) for l in f if "ctxt_switches:" in l)
        except OSError:
            pass  # a thread that ended meanwhile
    return total


ORT_SHARE = r"""
import glob, os, sys
import onnxruntime as ort
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS:")).split()[1]) / 1024
before = rss()
import numpy  # noqa: F401  (ferry has no Python; count only what ONNX Runtime adds)
before = rss()
sessions = []
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*", "1", "model.onnx"))):
    o = ort.SessionOptions()
    o.intra_op_num_threads = int(sys.argv[2])
    o.inter_op_num_threads = 1
    sessions.append(ort.InferenceSession(path, o, providers=["CPUExecutionProvider"]))
print(rss() - before)
"""


PACED_RUN = r"""
import os, re, sys, time
import numpy as np
import onnxruntime as ort
path, config, rate, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
text = open(config).read()
def param(key):
    m = re.search(r'key: *"%s" *value: *\{ *string_value: *"([^"]*)"' % key, text)
    return int(m.group(1)) if m and m.group(1).strip() not in ("", "0") else None
o = ort.SessionOptions()
o.intra_op_num_threads = param("intra_op_thread_count") or 2
o.inter_op_num_threads = param("inter_op_thread_count") or 1
o.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as the server runs it
s = ort.InferenceSession(path, o, providers=["CPUExecutionProvider"])
rng = np.random.default_rng(1)
feed = {}
for i in s.get_inputs():
    shape = [1] + [d if isinstance(d, int) and d > 0 else 1 for d in i.shape[1:]]
    feed[i.name] = (rng.integers(0, 100, shape).astype(np.int64) if "int64" in i.type
                    else rng.standard_normal(shape).astype(np.float32))
def paced(work):
    n, period = int(rate * seconds), 1.0 / rate
    t = os.times(); before = t.user + t.system
    start = time.perf_counter()
    for k in range(n):
        wait = start + k * period - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        work()
    t = os.times()
    return (t.user + t.system - before) / n
for _ in range(200):
    s.run(None, feed)
idle = paced(lambda: None)
print((paced(lambda: s.run(None, feed)) - idle) * 1e6)
"""


def paced_run(repo, model, rate, seconds):
    """CPU µs of one ONNX Runtime run of the model at batch 1 in-process, at the same pace as the
    server is driven, with the server's session settings (its threads, no spinning): what the
    model itself costs a request at that rate, caches cooled between requests as in the server.
    The pacing loop's own CPU is measured alone and taken off."""
    model_dir = os.path.join(repo, model)
    out = subprocess.run([sys.executable, "-c", PACED_RUN, os.path.join(model_dir, "1", "model.onnx"),
                          os.path.join(model_dir, "config.pbtxt"), str(rate), str(seconds)],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def ort_share(repo, threads):
    """Resident memory ONNX Runtime itself takes for the repository's models (in-process, the
    same thread count), over a Python that already imported numpy."""
    import onnxruntime  # noqa: F401  - the package the server loads its library from
    out = subprocess.run([sys.executable, "-c", ORT_SHARE, repo, str(threads)], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    return float(out.stdout.strip().splitlines()[-1])


def resident(pid):
    """Resident MiB by what holds it: the ferry binary's pages, ONNX Runtime's library pages, other
    libraries, and anonymous memory (heaps, stacks, sessions' weights)."""
    parts = {"binary": 0, "onnxruntime": 0, "libraries": 0, "anonymous": 0}
    kind, binary = "anonymous", os.readlink(f"/proc/{pid}/exe")
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                path = head[5] if len(head) > 5 else ""
                kind = ("binary" if path == binary else "onnxruntime" if "libonnxruntime" in path
                        else "libraries" if path.startswith("/") else "anonymous")
            elif head and head[0] == "Rss:":
                parts[kind] += int(head[1]) / 1024
    return parts


def memory(repo, empty):
    """Resident memory idle, with no model and with the repository loaded."""
    out = {}
    for label, r in (("no model", empty), ("loaded", repo)):
        http_port, grpc_port = run.free_port(), run.free_port()
        proc = run.start_server(r, http_port, grpc_port, [f"--metrics-port={run.free_port()}"])
        try:
            time.sleep(1)
            out[label] = resident(proc.pid)
        finally:
            proc.terminate()
            proc.wait()
    return out


def sample(base, model):
    """One realistic request's inputs (batch 1) as numpy arrays, from the model's metadata."""
    meta = run.get(f"{base}/v2/models/{model}")
    config = run.get(f"{base}/v2/models/{model}/config")
    batching = config.get("max_batch_size", 0) > 0
    rng = np.random.default_rng(1)
    arrays = {}
    for t in meta["inputs"]:
        shape = [d if d > 0 else 1 for d in t["shape"][1:]] if batching else [d if d > 0 else 1 for d in t["shape"]]
        if batching:
            shape = [1, *shape]
        dt = t["datatype"]
        if dt == "FP32":
            arrays[t["name"]] = (dt, rng.standard_normal(shape).astype(np.float32))
        elif dt == "INT64":
            arrays[t["name"]] = (dt, rng.integers(0, 100, shape).astype(np.int64))
        else:
            raise SystemExit(f"{model}: input datatype {dt} is not handled here")
    return arrays, [o["name"] for o in meta["outputs"]]


def http_binary(arrays, outputs):
    header, raw = {"inputs": [], "outputs": [{"name": o, "parameters": {"binary_data": True}} for o in outputs]}, b""
    for name, (dt, a) in arrays.items():
        data = a.tobytes()
        header["inputs"].append({"name": name, "shape": list(a.shape), "datatype": dt,
                                 "parameters": {"binary_data_size": len(data)}})
        raw += data
    head = json.dumps(header).encode()
    return head + raw, {"Inference-Header-Content-Length": str(len(head)), "Content-Type": "application/octet-stream"}


def http_json(arrays, outputs):
    body = {"inputs": [{"name": n, "shape": list(a.shape), "datatype": dt, "data": a.flatten().tolist()}
                       for n, (dt, a) in arrays.items()],
            "outputs": [{"name": o} for o in outputs]}
    return json.dumps(body).encode(), {"Content-Type": "application/json"}


def grpc_request(model, arrays, outputs):
    from tritonclient.grpc import service_pb2
    req = service_pb2.ModelInferRequest(model_name=model)
    for name, (dt, a) in arrays.items():
        t = req.inputs.add(name=name, datatype=dt)
        t.shape.extend(a.shape)
        req.raw_input_contents.append(a.tobytes())
    for o in outputs:
        req.outputs.add(name=o)
    return req.SerializeToString()


def drive(send_factory, rate, seconds, threads=4):
    """Each thread sends on its own connection, paced so the threads together offer `rate`/s.
    Returns (requests sent, errors)."""
    sent, errors, lock = [0], [0], threading.Lock()
    start = time.perf_counter() + 0.05
    period = threads / rate

    def worker(i):
        send = send_factory()
        k, ok, bad = 0, 0, 0
        while True:
            due = start + (i / rate) + k * period
            if due - start >= seconds:
                break
            now = time.perf_counter()
            if due > now:
                time.sleep(due - now)
            try:
                send()
                ok += 1
            except Exception as e:  # noqa: BLE001 - counted, reported once
                if bad == 0:
                    print(f"  request failed: {e}", file=sys.stderr)
                bad += 1
            k += 1
        with lock:
            sent[0] += ok
            errors[0] += bad

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sent[0], errors[0]


def http_sender(port, model, body, headers):
    """Keep-alive HTTP/1.1 on a raw socket: each request goes out in one write (as curl, which
    perf_analyzer uses, sends a small request), and the reply is read to its Content-Length."""
    head = f"POST /v2/models/{model}/infer HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    message = head.encode() + body

    def factory():
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()

        def send():
            sock.sendall(message)
            while (end := buf.find(b"\r\n\r\n")) < 0:
                buf.extend(sock.recv(65536) or b"")
            status = bytes(buf[:12])
            length = int(re.search(rb"(?im)^content-length: *(\d+)", buf[:end]).group(1))
            while len(buf) < end + 4 + length:
                buf.extend(sock.recv(65536) or b"")
            del buf[:end + 4 + length]
            if not status.endswith(b"200"):
                raise RuntimeError(status.decode(errors="replace"))
        return send
    return factory


def grpc_sender(port, body):
    import grpc

    def factory():
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer")

        def send():
            call(body, timeout=10)
        return send
    return factory


def measure(pid, base, model, factory, rate, seconds, profile):
    drive(factory, rate, 0.5)  # warm the connections and the model
    before = run.stats(base, model)[0], cpu_seconds(pid), time.perf_counter(), switches(pid)
    perf = None
    if profile:
        data = os.path.join(run.WORK, "cost.perf.data")
        perf = subprocess.Popen(["perf", "record", "-q", "-F", "1999", "-o", data, "-p", str(pid)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.3)
        before = run.stats(base, model)[0], cpu_seconds(pid), time.perf_counter(), switches(pid)
    sent, errors = drive(factory, rate, seconds)
    after = run.stats(base, model)[0], cpu_seconds(pid), time.perf_counter(), switches(pid)
    top = []
    if perf:
        perf.send_signal(2)
        perf.wait()
        top = flat_profile(os.path.join(run.WORK, "cost.perf.data"))
    n = after[0] - before[0]
    return {"requests": n, "errors": errors, "rate": n / (after[2] - before[2]),
            "us": (after[1] - before[1]) * 1e6 / max(n, 1), "switches": (after[3] - before[3]) / max(n, 1),
            "top": top}


def flat_profile(data, count=12):
    """perf's top symbols, after the share of each library (kernel, ferry, ONNX Runtime, libc)."""
    def report(fields):
        out = subprocess.run(["perf", "report", "-i", data, "--stdio", "--no-children", "-F", fields,
                              "--percent-limit", "0.5"], capture_output=True, text=True).stdout
        return [line.split(None, len(fields.split(","))) for line in out.splitlines()
                if line.strip() and line.split()[0].endswith("%")]
    rows = [(float(r[0][:-1]), r[1], "(all)") for r in report("overhead,dso")[:5]]
    for r in report("overhead,dso,sym")[:count]:
        symbol = " ".join(r[2:]).removeprefix("[.] ").removeprefix("[k] ")
        rows.append((float(r[0][:-1]), r[1], symbol[:90]))
    return rows


def start(binary, repo):
    os.environ["FERRY_BENCH_BIN"] = binary
    http_port, grpc_port = run.free_port(), run.free_port()
    proc = run.start_server(repo, http_port, grpc_port, [f"--metrics-port={run.free_port()}"])
    return {"proc": proc, "http": http_port, "grpc": grpc_port, "base": f"http://127.0.0.1:{http_port}"}


def factory_for(server, model, protocol, arrays, outputs):
    if protocol == "grpc":
        return grpc_sender(server["grpc"], grpc_request(model, arrays, outputs))
    body, headers = (http_binary if protocol == "http-binary" else http_json)(arrays, outputs)
    return http_sender(server["http"], model, body, headers)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--on", required=True, help="repository with dynamic batching on")
    p.add_argument("--off", required=True, help="the same repository with dynamic batching off")
    p.add_argument("--models", default="identity_fp32,mlp_small")
    p.add_argument("--protocols", default="http-binary,http-json,grpc")
    p.add_argument("--rate", type=float, default=1000.0, help="offered requests per second")
    p.add_argument("--seconds", type=float, default=4.0, help="per window")
    p.add_argument("--rounds", type=int, default=3, help="windows per row (the median is reported)")
    p.add_argument("--before", help="another build to measure beside this one, window after window")
    p.add_argument("--before-label", default="before")
    p.add_argument("--build", help="the build to measure (default target/release/ferry)")
    p.add_argument("--build-label", help="its commit, when --build names another one")
    p.add_argument("--profile", action="store_true", help="perf's top entries (one window per row, this build)")
    p.add_argument("--title", default="Server CPU per request")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args()
    os.makedirs(run.WORK, exist_ok=True)
    builds = [("this", args.build or os.path.join(run.ROOT, "target", "release", "ferry"))]
    if args.before:
        builds.insert(0, (args.before_label, args.before))
    rows, profiles = [], []
    names_this = f"`{args.build_label or run.commit_label()}`"
    for batching, repo in (("on", args.on), ("off", args.off)):
        # Every build serves at once (idle ones cost nothing), so drift hits them alike.
        servers = {}
        try:
            for label, binary in builds:
                servers[label] = start(binary, repo)
            time.sleep(1)
            for model in args.models.split(","):
                arrays, outputs = sample(servers["this"]["base"], model)
                for protocol in args.protocols.split(","):
                    got = {label: [] for label, _ in builds}
                    sw = {label: [] for label, _ in builds}
                    top = []
                    for _ in range(1 if args.profile else args.rounds):
                        for label, _ in builds:
                            srv = servers[label]
                            f = factory_for(srv, model, protocol, arrays, outputs)
                            m = measure(srv["proc"].pid, srv["base"], model, f, args.rate, args.seconds,
                                        args.profile and label == "this")
                            got[label].append(m["us"] if m["errors"] == 0 else float("nan"))
                            sw[label].append(m["switches"])
                            top = m["top"] or top
                    med = {label: statistics.median(v) for label, v in got.items()}
                    med_sw = {label: statistics.median(v) for label, v in sw.items()}
                    print(f"{model} {protocol} batching {batching}: " + ", ".join(
                        f"{label} {v:.0f} µs {med_sw[label]:.2f} switches" for label, v in med.items()), flush=True)
                    rows.append((model, protocol, batching, med, med_sw))
                    if top:
                        profiles.append((f"{names_this}, {model}, {protocol}, batching {batching}", top))
        finally:
            for srv in servers.values():
                srv["proc"].terminate()
                srv["proc"].wait()
    labels = [label for label, _ in builds]
    names = {"this": f"`{args.build_label or run.commit_label()}`", args.before_label: f"`{args.before_label}`"}
    body = [f"{time.strftime('%Y-%m-%d')}, release builds, {os.cpu_count()} cores. {args.rate:.0f} requests/s offered "
            f"by 4 paced client threads (Python, pre-built bodies, one write per HTTP request) on the same machine, "
            f"{args.seconds:.0f} s windows, "
            + ("one window per cell with perf recording (its sampling inflates the figures: the section without "
               "--profile has the costs)" if args.profile else f"the median of {args.rounds} windows per cell")
            + (", the builds measured window after window, all serving at once" if args.before else "")
            + ". Server CPU: user + system time of every server thread from /proc over the window, divided by the "
            "requests the server's statistics counted in it. Switches: the context switches of every server "
            "thread (/proc/<pid>/task/*/status) over the window, per request.", "",
            "| model | protocol | dynamic batching | " + " | ".join(f"µs per request, {names[l]}" for l in labels)
            + (" | change |" if args.before else " |") + " | ".join(f" switches per request, {names[l]}" for l in labels)
            + " |",
            "|---|---|---|" + "---|" * len(labels) + ("---|" if args.before else "") + "---|" * len(labels)]
    for model, protocol, batching, med, med_sw in rows:
        cells = " | ".join(f"{med[l]:.0f}" for l in labels)
        change = f" | {100 * (med['this'] / med[args.before_label] - 1):+.0f}%" if args.before else ""
        switch_cells = " | ".join(f"{med_sw[l]:.2f}" for l in labels)
        body.append(f"| {model} | {protocol} | {batching} | {cells}{change} | {switch_cells} |")
    if not args.profile:
        protocols = args.protocols.split(",")
        body += ["", f"What the model itself costs at the same pace: ONNX Runtime in-process (Python, the model's "
                 f"thread settings, no spinning), one batch-1 run every {1e6 / args.rate:.0f} µs, CPU µs per run "
                 f"(the median of {args.rounds} windows of {args.seconds:.0f} s, the pacing loop's own CPU taken off); "
                 f"the server's own share is the server's CPU per request without batching less that:", "",
                 "| model | model's CPU per run (µs) | " + " | ".join(f"server's own, {p} (µs)" for p in protocols) + " |",
                 "|---|---|" + "---|" * len(protocols)]
        for model in args.models.split(","):
            own = statistics.median(paced_run(args.off, model, args.rate, args.seconds) for _ in range(args.rounds))
            cells = []
            for p in protocols:
                med = next(r[3]["this"] for r in rows if r[0] == model and r[1] == p and r[2] == "off")
                cells.append(f"{med - own:.0f}")
            body.append(f"| {model} | {own:.0f} | " + " | ".join(cells) + " |")
        empty = os.path.join(run.WORK, "empty_repository")
        os.makedirs(empty, exist_ok=True)
        os.environ["FERRY_BENCH_BIN"] = builds[-1][1]
        mem = memory(args.on, empty)
        ort_mib = ort_share(args.on, 2)
        body += ["", f"Idle resident memory of {names['this']} (MiB), from /proc/<pid>/smaps one second after ready:",
                 "", "| server | total | ferry binary's pages | ONNX Runtime library's pages | other libraries | anonymous |",
                 "|---|---|---|---|---|---|"]
        for label, m in mem.items():
            body.append(f"| {label} | {sum(m.values()):.1f} | {m['binary']:.1f} | {m['onnxruntime']:.1f} | "
                        f"{m['libraries']:.1f} | {m['anonymous']:.1f} |")
        added = sum(mem["loaded"].values()) - sum(mem["no model"].values())
        body += ["", f"Loading the {len(os.listdir(args.on))} models adds {added:.0f} MiB. ONNX Runtime alone, in "
                 f"Python with the same models and 2 intra-op threads, adds {ort_mib:.0f} MiB over a Python with numpy."]
    for label, top in profiles:
        body += ["", f"Profile, {label} (perf, flat, share of the server's samples; `(all)`: the library's total):",
                 "", "| share | library | symbol |", "|---|---|---|"]
        body += [f"| {pct:.1f}% | {dso} | `{sym.replace('|', '/')}` |" for pct, dso, sym in top]
    text = "\n".join(body) + "\n"
    print(text)
    if not args.no_write:
        run.replace_section(os.path.join(run.BENCH, "RESULTS.md"), args.title, text)


if __name__ == "__main__":
    main()
