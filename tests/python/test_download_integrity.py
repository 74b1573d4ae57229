"""Download integrity against real S3 (moto) and GCS (fake-gcs-server) servers, through a proxy.
Checksums: for objects whose ETag is not an MD5 of the content (multipart S3 uploads with CRC32 or
SHA-256, checked part by part; composed GCS objects, CRC32C), a proxy that changes bytes of object
bodies (same length, same headers) stands in for a corrupted download: ferry refuses that version,
names the checksum, and keeps serving. Pinning: an object replaced while its parts download fails
that attempt (If-Match on every part) instead of mixing two uploads, and the next poll serves the
new one. Listing: the repository index answers from the last listing, so clients asking for it
cannot make ferry list the bucket on every call."""
import json
import re
import socket
import threading
import time
import urllib.parse

import numpy as np
import pytest
import tritonclient.http as httpclient
from onnx import TensorProto, helper, numpy_helper

import models
from buckets import StorageServer, http
from ferry_server import Server

MARKER = b"ferry-checksum-marker-"
PART = 5 << 20  # S3's smallest part


def model_bytes(path, add=0.0):
    """y = x + add, with an unused 6 MiB initializer made of MARKER (so the file has two S3
    parts, and six 1 MiB ranged parts to download)."""
    fill = np.frombuffer((MARKER * ((6 << 20) // len(MARKER) + 1))[: 6 << 20], dtype=np.uint8)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph([helper.make_node("Add", ["x", "k"], ["y"])], "m", [x], [y],
                              initializer=[numpy_helper.from_array(fill, "pad"),
                                           numpy_helper.from_array(np.array(add, np.float32), "k")])
    models.save(graph, path, opset=13)
    return open(path, "rb").read()


class Proxy:
    """A TCP proxy to `port`. `corrupt`: changes one byte of every MARKER the server sends back.
    `before_parts`: called once, on the second ranged GET, before it goes on."""

    def __init__(self, port, corrupt=False, before_parts=None):
        self.upstream, self.corrupt, self.before_parts = port, corrupt, before_parts
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.here, self.there = f"127.0.0.1:{self.port}".encode(), f"127.0.0.1:{port}".encode()
        self.changed, self.ranged, self.lists = 0, 0, 0
        self.hooked, self.lock = threading.Event(), threading.Lock()
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            client, _ = self.listener.accept()
            upstream = socket.create_connection(("127.0.0.1", self.upstream))
            threading.Thread(target=self.pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self.pipe, args=(upstream, client, True), daemon=True).start()

    def pipe(self, src, dst, replies):
        try:
            while data := src.recv(1 << 16):
                if replies and self.corrupt and MARKER in data:
                    self.changed += data.count(MARKER)
                    data = data.replace(MARKER, MARKER[:-1] + b"!")
                elif not replies:
                    if data.startswith(b"GET ") and b"list-type=2" in data.split(b"\r\n", 1)[0]:
                        self.lists += 1
                    if self.before_parts and data.startswith(b"GET ") and b"\nrange:" in data.lower():
                        with self.lock:
                            self.ranged += 1
                            if self.ranged == 2:
                                self.before_parts()
                                self.hooked.set()
                    data = data.replace(self.here, self.there)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


@pytest.fixture(scope="module")
def onnx_file(tmp_path_factory):
    return model_bytes(str(tmp_path_factory.mktemp("m") / "model.onnx"))


def s3_multipart(bucket, key, data, algorithm):
    s3 = bucket.s3
    upload = s3.create_multipart_upload(Bucket=bucket.name, Key=key, ChecksumAlgorithm=algorithm)
    parts = []
    for n, at in enumerate(range(0, len(data), PART), start=1):
        r = s3.upload_part(Bucket=bucket.name, Key=key, UploadId=upload["UploadId"], PartNumber=n,
                           Body=data[at:at + PART], ChecksumAlgorithm=algorithm)
        parts.append({"PartNumber": n, "ETag": r["ETag"], f"Checksum{algorithm}": r[f"Checksum{algorithm}"]})
    s3.complete_multipart_upload(Bucket=bucket.name, Key=key, UploadId=upload["UploadId"],
                                 MultipartUpload={"Parts": parts})
    head = s3.head_object(Bucket=bucket.name, Key=key, ChecksumMode="ENABLED")
    assert head["ETag"].strip('"').endswith(f"-{len(parts)}") and head.get(f"Checksum{algorithm}"), head


def gcs_composed(bucket, key, data):
    """`key` composed of two uploaded halves (a composite object: CRC32C, no MD5)."""
    half = len(data) // 2
    for i, piece in enumerate((data[:half], data[half:])):
        bucket.put(f"{key}.piece{i}", piece)
    body = {"sourceObjects": [{"name": f"{key}.piece{i}"} for i in range(2)],
            "destination": {"contentType": "application/octet-stream"}}
    http("POST", f"{bucket.endpoint}/storage/v1/b/{bucket.name}/o/{urllib.parse.quote(key, safe='')}/compose",
         json.dumps(body).encode(), {"Content-Type": "application/json"})
    for i in range(2):
        bucket.delete(f"{key}.piece{i}")


def serve(bucket, endpoint, tmp_path, name, *extra):
    flag = "--s3-endpoint" if bucket.scheme == "s3" else "--gcs-endpoint"
    args = [a for a in bucket.server_args() if not a.startswith(flag)]
    return Server(["--model-repository", bucket.url("repo"), f"{flag}={endpoint}", *args, "--exit-on-error=false",
                   f"--model-cache-dir={tmp_path / name}", *extra], env=bucket.server_env())


@pytest.mark.parametrize("kind,algorithm", [("s3", "CRC32"), ("s3", "SHA256"), ("gcs", "CRC32C")])
def test_downloads_are_checked_against_the_stores_checksums(kind, algorithm, onnx_file, tmp_path):
    storage = StorageServer(kind)
    try:
        bucket = storage.bucket("checked")
        bucket.put("repo/m/config.pbtxt", b'name: "m"\nmax_batch_size: 8\n')
        if kind == "s3":
            s3_multipart(bucket, "repo/m/1/model.onnx", onnx_file, algorithm)
        else:
            gcs_composed(bucket, "repo/m/1/model.onnx", onnx_file)
        # Straight from the store: the checksums agree and the model serves.
        with serve(bucket, storage.endpoint, tmp_path, "direct") as s:
            assert s.client().is_model_ready("m"), s.log()
        # Through the proxy that changes bytes: refused, named, nothing half loaded.
        proxy = Proxy(int(storage.endpoint.rsplit(":", 1)[1]), corrupt=True)
        with serve(bucket, proxy.endpoint, tmp_path, "corrupted") as s:
            assert proxy.changed > 0
            assert not s.client().is_model_ready("m")
            [entry] = [m for m in s.client().get_model_repository_index() if m["name"] == "m"]
            named = {"CRC32": "CRC32", "SHA256": "SHA-256", "CRC32C": "CRC32C"}[algorithm]
            assert entry["state"] == "UNAVAILABLE", entry
            assert re.search(rf"has (composite )?{named} [0-9a-f]+, the store says", s.log()), s.log()
            assert s.client().is_server_live()
    finally:
        storage.stop()


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_an_object_replaced_during_its_download_is_never_mixed(kind, tmp_path):
    storage = StorageServer(kind)
    try:
        bucket = storage.bucket("pinned")
        bucket.put("repo/m/config.pbtxt", b'name: "m"\nmax_batch_size: 8\n')
        first, second = (model_bytes(str(tmp_path / f"{k}.onnx"), add=k) for k in (1.0, 2.0))
        assert len(first) == len(second)
        bucket.put("repo/m/1/model.onnx", first)
        # Parts one at a time; the object is replaced by a different upload of the same size
        # after the first part, so an unpinned download would join two uploads.
        proxy = Proxy(int(storage.endpoint.rsplit(":", 1)[1]),
                      before_parts=lambda: bucket.put("repo/m/1/model.onnx", second))
        with serve(bucket, proxy.endpoint, tmp_path, "pinned", "--storage-part-mib=1", "--storage-parallelism=1",
                   "--model-control-mode=poll", "--repository-poll-secs=1") as s:
            assert proxy.hooked.is_set()
            assert "changed while it was downloaded" in s.log(), s.log()
            x = httpclient.InferInput("x", [1, 4], "FP32").set_data_from_numpy(np.zeros((1, 4), np.float32))

            def served():
                try:
                    return s.client().infer("m", [x]).as_numpy("y")[0, 0]
                except Exception:  # noqa: BLE001 - not loaded yet
                    return None
            seen, deadline = set(), time.time() + 60
            while 2.0 not in seen and time.time() < deadline:
                seen.add(served())
                time.sleep(0.2)
            assert seen <= {None, 1.0, 2.0} and 2.0 in seen, (seen, s.log())
            assert "ONNX Runtime cannot load" not in s.log(), "never a joined file"
    finally:
        storage.stop()


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_the_index_answers_from_the_last_listing(kind, tmp_path, onnx_file):
    storage = StorageServer(kind)
    try:
        bucket = storage.bucket("listed")
        bucket.put("repo/m/config.pbtxt", b'name: "m"\nmax_batch_size: 8\n')
        bucket.put("repo/m/1/model.onnx", onnx_file)
        proxy = Proxy(int(storage.endpoint.rsplit(":", 1)[1]))
        with serve(bucket, proxy.endpoint, tmp_path, "listed", "--model-control-mode=poll",
                   "--repository-poll-secs=3600") as s:
            assert s.client().is_model_ready("m")
            before = proxy.lists
            for _ in range(50):
                assert [m["name"] for m in s.client().get_model_repository_index()] == ["m"]
                s.grpc_client().get_model_repository_index()
            assert before >= 1 and proxy.lists == before, (before, proxy.lists)
    finally:
        storage.stop()
