#!/usr/bin/env python3
"""`/v1/embeddings` on a MiniLM-sized encoder (6 layers, hidden 384, 12 heads, vocabulary 30,522,
random weights with a fixed seed), three ways, one text per request at concurrency 1 and 16:

  - ferry's OpenAI route over the no-Python pipeline (ferry_tokenizer with a WordPiece
    tokenizer.json, the encoder in ONNX Runtime, ferry_postprocess mean pooling), dynamic batching;
  - the same pipeline through KServe v2 infer (JSON), for the OpenAI layer's cost;
  - the usual "before": sentence-transformers (the same weights and tokenizer, mean pooling,
    normalised) behind FastAPI on uvicorn, one worker, as a team would first write it.

Needs a Python with torch, transformers, sentence-transformers, fastapi, uvicorn, onnx and
onnxruntime (PyPI; the CUDA wheels torch pulls in are not used), and a release build:

    python3 -m venv /tmp/st && /tmp/st/bin/pip install sentence-transformers fastapi uvicorn onnx onnxruntime
    cargo build --release && /tmp/st/bin/python bench/openai_embeddings.py

Also checks that ferry's vectors equal sentence-transformers' (cosine > 0.999). Writes the section
"OpenAI embeddings" of bench/RESULTS.md.
"""
import datetime
import http.client
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time

import numpy as np

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
import run  # noqa: E402

WORK = os.path.join(BENCH, ".work", "openai")
SECONDS = float(os.environ.get("BENCH_SECONDS", "10"))
MAX_LENGTH = 32

APP = '''
from fastapi import FastAPI
from pydantic import BaseModel
from sentence_transformers import SentenceTransformer

model = SentenceTransformer(MODEL_DIR, device="cpu")
app = FastAPI()


class Body(BaseModel):
    input: list[str] | str
    model: str = ""


@app.post("/v1/embeddings")
def embeddings(body: Body):
    texts = [body.input] if isinstance(body.input, str) else body.input
    vectors = model.encode(texts, normalize_embeddings=True)
    return {"object": "list", "model": body.model,
            "data": [{"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)]}
'''


def words(n):
    rnd = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out = set()
    while len(out) < n:
        out.add("".join(rnd.choice(letters) for _ in range(rnd.randint(3, 9))))
    return sorted(out)


def build():
    """The tokenizer, the encoder (saved for sentence-transformers, exported to ONNX for ferry)
    and ferry's repository, once."""
    repo = os.path.join(WORK, "repo")
    if os.path.exists(os.path.join(repo, "minilm_onnx", "1", "model.onnx")):
        return repo
    import torch
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertConfig, BertModel, BertTokenizerFast

    os.makedirs(WORK, exist_ok=True)
    vocab = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab += words(30522 - len(vocab))
    vocab_file = os.path.join(WORK, "vocab.txt")
    with open(vocab_file, "w") as f:
        f.write("\n".join(vocab) + "\n")
    hf_dir = os.path.join(WORK, "minilm")
    tokenizer_json = os.path.join(WORK, "tokenizer.json")
    BertWordPieceTokenizer(vocab_file, lowercase=True).save(tokenizer_json)
    # The same tokenizer on both sides (made from the vocabulary alone, transformers 5 leaves it empty).
    tok = BertTokenizerFast(tokenizer_file=tokenizer_json, model_max_length=MAX_LENGTH, unk_token="[UNK]",
                            pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    if tok("abc")["input_ids"][0] != vocab.index("[CLS]"):
        sys.exit("the Hugging Face tokenizer does not read the vocabulary")
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                     intermediate_size=1536, max_position_embeddings=512)
    bert = BertModel(cfg, add_pooling_layer=False).eval()
    bert.save_pretrained(hf_dir)
    tok.save_pretrained(hf_dir)
    st = SentenceTransformer(modules=[models.Transformer(hf_dir, max_seq_length=MAX_LENGTH),
                                      models.Pooling(384, pooling_mode="mean"), models.Normalize()])
    st.save(os.path.join(WORK, "st"))

    class Encoder(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, input_ids, attention_mask):
            return self.m(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    for d in ("minilm", "minilm_tokens", "minilm_onnx", "minilm_pool"):
        os.makedirs(os.path.join(repo, d, "1"), exist_ok=True)
    ids = torch.ones(2, MAX_LENGTH, dtype=torch.int64)
    axes = {"input_ids": {0: "b", 1: "s"}, "attention_mask": {0: "b", 1: "s"}, "last_hidden_state": {0: "b", 1: "s"}}
    torch.onnx.export(Encoder(bert), (ids, ids), os.path.join(repo, "minilm_onnx", "1", "model.onnx"),
                      input_names=["input_ids", "attention_mask"], output_names=["last_hidden_state"],
                      dynamic_axes=axes, dynamo=False, opset_version=17)
    shutil.copy(tokenizer_json, os.path.join(repo, "minilm_tokens", "1", "tokenizer.json"))
    configs = {
        "minilm_tokens": f'''backend: "ferry_tokenizer"
max_batch_size: 16
dynamic_batching {{ }}
parameters [ {{ key: "max_length" value {{ string_value: "{MAX_LENGTH}" }} }}, {{ key: "padding" value {{ string_value: "max_length" }} }} ]
input [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "input_ids" data_type: TYPE_INT64 dims: [ {MAX_LENGTH} ] }}, {{ name: "attention_mask" data_type: TYPE_INT64 dims: [ {MAX_LENGTH} ] }} ]
''',
        "minilm_onnx": '''platform: "onnxruntime_onnx"
max_batch_size: 16
dynamic_batching { }
''',
        "minilm_pool": f'''backend: "ferry_postprocess"
max_batch_size: 16
dynamic_batching {{ }}
parameters [ {{ key: "operation" value {{ string_value: "pool" }} }}, {{ key: "normalize" value {{ string_value: "true" }} }} ]
input [ {{ name: "HIDDEN" data_type: TYPE_FP32 dims: [ {MAX_LENGTH}, 384 ] }}, {{ name: "MASK" data_type: TYPE_INT64 dims: [ {MAX_LENGTH} ] }} ]
output [ {{ name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 384 ] }} ]
''',
        "minilm": f'''platform: "ensemble"
max_batch_size: 16
input [ {{ name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] }} ]
output [ {{ name: "EMBEDDING" data_type: TYPE_FP32 dims: [ 384 ] }}, {{ name: "attention_mask" data_type: TYPE_INT64 dims: [ {MAX_LENGTH} ] }} ]
ensemble_scheduling {{ step [
  {{ model_name: "minilm_tokens" model_version: -1 input_map {{ key: "TEXT" value: "TEXT" }}
    output_map {{ key: "input_ids" value: "ids" }} output_map {{ key: "attention_mask" value: "attention_mask" }} }},
  {{ model_name: "minilm_onnx" model_version: -1 input_map {{ key: "input_ids" value: "ids" }}
    input_map {{ key: "attention_mask" value: "attention_mask" }} output_map {{ key: "last_hidden_state" value: "hidden" }} }},
  {{ model_name: "minilm_pool" model_version: -1 input_map {{ key: "HIDDEN" value: "hidden" }}
    input_map {{ key: "MASK" value: "attention_mask" }} output_map {{ key: "EMBEDDING" value: "EMBEDDING" }} }}
] }}
''',
    }
    for name, text in configs.items():
        with open(os.path.join(repo, name, "config.pbtxt"), "w") as f:
            f.write(f'name: "{name}"\n' + text)
    return repo


def texts(n):
    vocab = words(30522 - 103)
    rnd = random.Random(11)
    return [" ".join(rnd.choice(vocab) for _ in range(rnd.randint(12, 20))) for _ in range(n)]


def post(port, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", path, body, {"Content-Type": "application/json"})
    r = conn.getresponse()
    data = r.read()
    conn.close()
    if r.status != 200:
        raise RuntimeError(f"{path}: {r.status} {data[:200]!r}")
    return json.loads(data)


def load(port, path, bodies, concurrency):
    """Requests from `concurrency` keep-alive connections for SECONDS: (requests/s, p50 ms)."""
    stop = time.time() + SECONDS
    latencies, errors = [], []

    def client(k):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        i = k
        while time.time() < stop:
            t = time.perf_counter()
            conn.request("POST", path, bodies[i % len(bodies)], {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            if r.status != 200:
                errors.append(r.status)
                return
            latencies.append(time.perf_counter() - t)
            i += concurrency

    # A short warm-up, then the measured window.
    for b in bodies[:4]:
        post(port, path, b)
    threads = [threading.Thread(target=client, args=(k,)) for k in range(concurrency)]
    start = time.time()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{path}: status {errors[0]}")
    return len(latencies) / (time.time() - start), 1000 * float(np.median(latencies))


def wait_http(port, proc, path):
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({path})")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    sys.exit("the server did not start")


def main():
    repo = build()
    sample = texts(256)
    openai_bodies = [json.dumps({"model": "minilm", "input": t}) for t in sample]
    kserve_bodies = [json.dumps({"inputs": [{"name": "TEXT", "datatype": "BYTES", "shape": [1, 1], "data": [t]}],
                                 "outputs": [{"name": "EMBEDDING"}]}) for t in sample]
    rows, check = [], None
    http_port = run.free_port()
    proc = run.start_server(repo, http_port, run.free_port(), [])
    try:
        ferry_vectors = np.array(post(http_port, "/v1/embeddings", json.dumps({"model": "minilm", "input": sample[:8]}))
                                 ["data"][0]["embedding"])
        for c in (1, 16):
            rows.append(("ferry /v1/embeddings", c, *load(http_port, "/v1/embeddings", openai_bodies, c)))
            rows.append(("ferry KServe v2 infer (JSON)", c, *load(http_port, "/v2/models/minilm/infer", kserve_bodies, c)))
        stats = json.loads(urllib_get(http_port, "/v2/models/minilm_onnx/stats"))["model_stats"][0]
        batch = stats["inference_count"] / max(stats["execution_count"], 1)
    finally:
        proc.terminate()
        proc.wait()
    st_port = run.free_port()
    app_dir = os.path.join(WORK, "app")
    os.makedirs(app_dir, exist_ok=True)
    with open(os.path.join(app_dir, "app.py"), "w") as f:
        f.write(f"MODEL_DIR = {os.path.join(WORK, 'st')!r}\n" + APP)
    st = subprocess.Popen([sys.executable, "-m", "uvicorn", "app:app", "--port", str(st_port), "--log-level", "warning"],
                          cwd=app_dir)
    try:
        wait_http(st_port, st, "uvicorn")
        want = np.array(post(st_port, "/v1/embeddings", json.dumps({"input": sample[:8]}))["data"][0]["embedding"])
        check = float(ferry_vectors @ want / (np.linalg.norm(ferry_vectors) * np.linalg.norm(want)))
        for c in (1, 16):
            rows.append(("sentence-transformers + FastAPI", c, *load(st_port, "/v1/embeddings", openai_bodies, c)))
    finally:
        st.terminate()
        st.wait()
    write(rows, batch, check)


def urllib_get(port, path):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)
    return conn.getresponse().read()


def write(rows, batch, check):
    import sentence_transformers
    import torch
    by = {(name, c): (rps, p50) for name, c, rps, p50 in rows}
    lines = [
        f"Commit `{run.commit_label()}`, {datetime.date.today()}, {os.cpu_count()} cores, release build, one text of "
        f"12–20 words per request, keep-alive HTTP clients in Python threads on the same machine, {SECONDS:.0f} s "
        f"per point. The encoder is MiniLM-sized (6 layers, hidden 384; random weights); ferry pads to "
        f"{MAX_LENGTH} tokens (fixed, so requests batch), sentence-transformers to each text's length. "
        f"torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__}.",
        "",
        "| server | concurrency | requests/s | p50 ms |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {c} | {rps:.0f} | {p50:.1f} |" for name, c, rps, p50 in rows]
    oa, kv, st = (by[("ferry /v1/embeddings", 16)], by[("ferry KServe v2 infer (JSON)", 16)],
                  by[("sentence-transformers + FastAPI", 16)])
    lines += [
        "",
        f"- The OpenAI layer at c16: {oa[0] / kv[0]:.2f}× the KServe v2 throughput (target ≥ 0.95).",
        f"- ferry over sentence-transformers + FastAPI at c16: {oa[0] / st[0]:.1f}× (target ≥ 3×).",
        f"- Average batch the encoder ran at (ferry, all points): {batch:.1f}.",
        f"- ferry's vector equals sentence-transformers' (same weights and tokenizer): cosine {check:.6f}.",
    ]
    run.replace_section(os.path.join(BENCH, "RESULTS.md"), "OpenAI embeddings", "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
