"""Helpers for the tests that start ferry the way Vertex AI and SageMaker do."""
import http.client
import json
import socket
import time

import numpy as np

import models


def request(port, method, path, body=b"", headers=None, timeout=30):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    if isinstance(body, (dict, list)):
        body = json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **(headers or {})}
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, resp.headers, data


def kserve_simple(a, b):
    return {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "INT32", "data": a},
                       {"name": "INPUT1", "shape": [1, 16], "datatype": "INT32", "data": b}]}


def binary_simple(a, b):
    """A KServe v2 binary body for `simple`, and its JSON header length."""
    header = json.dumps({"inputs": [{"name": n, "shape": [1, 16], "datatype": "INT32", "parameters": {"binary_data_size": 64}}
                                    for n in ("INPUT0", "INPUT1")],
                         "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": True}}]}).encode()
    return header + np.array(a, dtype=np.int32).tobytes() + np.array(b, dtype=np.int32).tobytes(), len(header)


def slow_model(repo, name="slow", seconds_of_warmup=20000):
    """add_mul with enough warmup runs that loading takes a few seconds."""
    models.add_mul(repo, name, config=f'''name: "{name}"
max_batch_size: 8
model_warmup [ {{ name: "w" batch_size: 1 count: {seconds_of_warmup}
  inputs {{ key: "a" value: {{ data_type: TYPE_FP32 dims: [ 4 ] zero_data: true }} }}
  inputs {{ key: "b" value: {{ data_type: TYPE_FP32 dims: [ 4 ] zero_data: true }} }} }} ]
''')


def connect_quickly(port, within=5.0):
    deadline = time.time() + within
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.02)
    return False


def snapshot(folder):
    """Names, sizes and modification times of everything under a folder."""
    import os
    out = {}
    for root, dirs, files in os.walk(folder):
        for n in dirs + files:
            p = os.path.join(root, n)
            st = os.lstat(p)
            out[p] = (st.st_size, st.st_mtime_ns)
    return out
