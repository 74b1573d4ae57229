"""Model repositories in buckets, against real S3 (moto) and GCS (fake-gcs-server) servers:
serving, the object cache, poll mode's completeness rule, broken versions, explicit loads,
credential errors, Vertex AI's AIP_STORAGE_URI, and a soak test of version swaps under load."""
import hashlib
import itertools
import json
import os
import threading
import time

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import models
from buckets import StorageServer
from ferry_server import Server

NAME = "add_mul"
CONFIG = f'name: "{NAME}"\nmax_batch_size: 8\ndynamic_batching {{}}\n'
_names = itertools.count()


@pytest.fixture(scope="module", params=["s3", "gcs"])
def storage(request):
    server = StorageServer(request.param)
    yield server
    server.stop()


@pytest.fixture
def bucket(storage):
    return storage.bucket(f"bucket{next(_names)}")


def model_files(tmp_path, version):
    """The files of add_mul version `version` (y = a + b + version - 1), relative to the model."""
    folder = tmp_path / f"v{version}"
    models.add_mul(str(folder), NAME, versions=(version,), config=CONFIG)
    root = folder / NAME
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def upload(bucket, prefix, files):
    for rel, data in files.items():
        bucket.put(f"{prefix}/{NAME}/{rel}", data)


def upload_version(bucket, prefix, tmp_path, version, marker=True):
    files = model_files(tmp_path, version)
    upload(bucket, prefix, files)
    if marker:
        bucket.put(f"{prefix}/{NAME}/{version}/_READY", b"")
    return files


def start(bucket, prefix, tmp_path, *args, env=None, **kw):
    cache = tmp_path / "cache"
    return Server(["--model-repository", bucket.url(prefix), *bucket.server_args(), f"--model-cache-dir={cache}", *args],
                  env={**bucket.server_env(), **(env or {})}, **kw)


def inputs(module, a):
    ins = [module.InferInput("a", list(a.shape), "FP32"), module.InferInput("b", list(a.shape), "FP32")]
    for i in ins:
        i.set_data_from_numpy(a)
    return ins


def served_version(client, module=httpclient):
    """(the version the response names, the version its numbers come from)."""
    a = np.full((1, 4), 2.0, np.float32)
    result = client.infer(NAME, inputs(module, a))
    y = result.as_numpy("y")
    response = result.get_response()
    named = response["model_version"] if isinstance(response, dict) else response.model_version
    return int(named), int(round(float(y[0, 0]) - 4.0)) + 1


def wait_for(check, what, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def index(server):
    return {(m["name"], m.get("version")): m for m in server.client().get_model_repository_index()}


def test_serves_a_bucket_and_reuses_the_cache(bucket, tmp_path):
    upload_version(bucket, "repo", tmp_path, 1, marker=False)
    with start(bucket, "repo", tmp_path) as s:
        assert served_version(s.client()) == (1, 1)
        assert s.client().is_model_ready(NAME)
        principal = "arn:aws:sts::" if bucket.scheme == "s3" else "anonymous (--storage-anonymous)"
        assert f"principal={principal}" in s.log(), s.log()
        assert "downloading model files" in s.log()
    with start(bucket, "repo", tmp_path) as s:
        assert served_version(s.client()) == (1, 1)
        assert "downloading model files" not in s.log(), "a restart on the same disk downloads nothing"


def test_poll_loads_a_marked_version_only_once_it_is_marked(bucket, tmp_path):
    upload_version(bucket, "repo", tmp_path, 1)
    with start(bucket, "repo", tmp_path, "--model-control-mode=poll", "--repository-poll-secs=1") as s:
        assert served_version(s.client()) == (1, 1)
        upload_version(bucket, "repo", tmp_path, 2, marker=False)
        assert s.wait_log("version 2 is not complete yet: it has no _READY", timeout=30), s.log()
        time.sleep(3)  # a few more polls
        assert served_version(s.client()) == (1, 1), "an unmarked version never serves"
        bucket.put(f"repo/{NAME}/2/_READY", b"")
        wait_for(lambda: served_version(s.client()) == (2, 2), "version 2 to serve")
        wait_for(lambda: (NAME, "1") not in index(s) or index(s)[(NAME, "1")]["state"] != "READY", "version 1 to retire")
        assert "failed to load" not in s.log()


def test_poll_waits_for_an_unmarked_upload_to_settle(bucket, tmp_path):
    upload_version(bucket, "repo", tmp_path, 1, marker=False)
    with start(bucket, "repo", tmp_path, "--model-control-mode=poll", "--repository-poll-secs=2") as s:
        assert served_version(s.client()) == (1, 1)
        files = model_files(tmp_path, 2)
        onnx = files.pop("2/model.onnx")
        upload(bucket, "repo", files)
        bucket.put(f"repo/{NAME}/2/model.onnx", onnx[: len(onnx) // 2])  # the upload is half-way
        assert s.wait_log("version 2 changed since the last poll", timeout=30), s.log()
        bucket.put(f"repo/{NAME}/2/model.onnx", onnx)  # and now complete
        wait_for(lambda: served_version(s.client()) == (2, 2), "version 2 to serve")
        assert "failed to load" not in s.log(), "the half-written file was never loaded"


def test_manifest_sizes_and_digests(bucket, tmp_path):
    upload_version(bucket, "repo", tmp_path, 1)
    with start(bucket, "repo", tmp_path, "--model-control-mode=poll", "--repository-poll-secs=1") as s:
        files = model_files(tmp_path, 2)
        onnx = files["2/model.onnx"]
        manifest = {"files": [{"path": "model.onnx", "size": len(onnx), "sha256": hashlib.sha256(onnx).hexdigest()}]}
        bucket.put(f"repo/{NAME}/config.pbtxt", CONFIG.encode())
        bucket.put(f"repo/{NAME}/2/_MANIFEST.json", json.dumps(manifest).encode())
        assert s.wait_log("'model.onnx' in _MANIFEST.json is not uploaded", timeout=30), s.log()
        assert served_version(s.client()) == (1, 1)
        bucket.put(f"repo/{NAME}/2/model.onnx", onnx)
        wait_for(lambda: served_version(s.client()) == (2, 2), "version 2 to serve")

        # Version 3 arrives with the right size but the wrong bytes: it never serves.
        onnx3 = model_files(tmp_path, 3)["3/model.onnx"]
        manifest = {"files": [{"path": "model.onnx", "size": len(onnx3), "md5": hashlib.md5(onnx).hexdigest()}]}
        bucket.put(f"repo/{NAME}/3/model.onnx", onnx3)
        bucket.put(f"repo/{NAME}/3/_MANIFEST.json", json.dumps(manifest).encode())
        assert s.wait_log("its _MANIFEST.json says", timeout=30), s.log()
        assert served_version(s.client()) == (2, 2)
        # The index takes the reason once the failed attempt is recorded (just after the log line).
        reason = wait_for(lambda: index(s)[(NAME, "2")].get("reason"), "the reason in the index")
        assert "has MD5" in reason and "still serving the previous load" in reason, reason


def test_a_broken_version_or_config_leaves_the_old_one_serving(bucket, tmp_path):
    upload_version(bucket, "repo", tmp_path, 1)
    with start(bucket, "repo", tmp_path, "--model-control-mode=poll", "--repository-poll-secs=1") as s:
        bucket.put(f"repo/{NAME}/2/model.onnx", b"this is not an ONNX model" * 10)
        bucket.put(f"repo/{NAME}/2/_READY", b"")
        assert s.wait_log("load failed; what served keeps serving", timeout=30), s.log()
        assert served_version(s.client()) == (1, 1)
        v1 = index(s)[(NAME, "1")]
        assert v1["state"] == "READY" and "2/model.onnx" in v1["reason"], v1

        bucket.put(f"repo/{NAME}/config.pbtxt", b'name: "add_mul"\nmax_batch_size: "eight"\n')
        wait_for(lambda: "max_batch_size" in index(s)[(NAME, "1")]["reason"], "the config error in the index")
        assert served_version(s.client()) == (1, 1)

        bucket.delete_prefix(f"repo/{NAME}/")
        wait_for(lambda: not s.client().is_model_ready(NAME), "the removed model to unload")
        assert "the model left the repositories; unloading" in s.log()


def test_staging_copies_are_collected_only_once_a_replacement_serves(bucket, tmp_path):
    upload_version(bucket, "repo", tmp_path, 1)
    models_dir = tmp_path / "cache" / "models"
    with start(bucket, "repo", tmp_path, "--model-control-mode=poll", "--repository-poll-secs=1") as s:
        assert served_version(s.client()) == (1, 1)
        first = set(os.listdir(models_dir))
        assert first, "version 1 serves from a staging copy"
        stale = models_dir / "0123abcd.partial-999999999"
        stale.mkdir()
        # A version that fails to load: the copy version 1 runs from stays, and so does anything
        # the collection would take (it runs only after a successful load).
        bucket.put(f"repo/{NAME}/2/model.onnx", b"this is not an ONNX model" * 10)
        bucket.put(f"repo/{NAME}/2/_READY", b"")
        assert s.wait_log("load failed; what served keeps serving", timeout=30), s.log()
        assert first <= set(os.listdir(models_dir)) and stale.is_dir()
        assert served_version(s.client()) == (1, 1)
        # A good version 3 serves: the older copies and the dead process's half-built one go.
        upload_version(bucket, "repo", tmp_path, 3)
        wait_for(lambda: served_version(s.client()) == (3, 3), "version 3")
        wait_for(lambda: not stale.exists() and not first & set(os.listdir(models_dir)), "the collection")
        assert served_version(s.client()) == (3, 3)


def test_explicit_loads_from_a_bucket(bucket, tmp_path):
    upload_version(bucket, "repo", tmp_path, 1)
    with start(bucket, "repo", tmp_path, "--model-control-mode=explicit", "--repository-poll-secs=1") as s:
        client = s.client()
        assert not client.is_model_ready(NAME)
        assert [m["name"] for m in client.get_model_repository_index()] == [NAME]
        client.load_model(NAME)
        assert served_version(client) == (1, 1)
        upload_version(bucket, "repo", tmp_path, 2)
        client.load_model(NAME)
        assert served_version(client) == (2, 2)
        bucket.put(f"repo/other/1/_READY", b"")
        # The index lists the bucket again once its last listing is older than the poll interval
        # (at most one listing per interval, however often clients ask).
        wait_for(lambda: [m["name"] for m in client.get_model_repository_index()] == [NAME, "other"],
                 "the index to list the bucket again")


def test_missing_credentials_and_buckets_are_clear_errors(storage, tmp_path):
    if storage.kind == "s3":
        env = no_aws_credentials(tmp_path)
        args = [f"--s3-endpoint={storage.endpoint}"]
        expected = "no AWS credentials for s3://nobody"
    else:
        env = {"GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "missing-key.json")}
        args = [f"--gcs-endpoint={storage.endpoint}"]
        expected = "cannot open gs://nobody"
    url = f"{'s3' if storage.kind == 's3' else 'gs'}://nobody/repo"
    s = Server(["--model-repository", url, *args], env=env, expect_exit=True)
    assert s.wait_exit() != 0
    assert expected in s.log(), s.log()

    bucket = storage.bucket(f"bucket{next(_names)}")
    good_env = bucket.server_env()
    args = bucket.server_args()
    missing = f"{bucket.scheme}://no-such-bucket-{next(_names)}/repo"
    s = Server(["--model-repository", missing, *args], env=good_env, expect_exit=True)
    assert s.wait_exit() != 0
    assert "in bucket 'no-such-bucket" in s.log(), s.log()


def test_vertex_reads_aip_storage_uri(storage, tmp_path):
    if storage.kind != "gcs":
        pytest.skip("Vertex AI hands over a gs:// URI")
    bucket = storage.bucket(f"bucket{next(_names)}")
    upload_version(bucket, "artifacts", tmp_path, 1)
    env = {"AIP_MODE": "PREDICTION", "AIP_HTTP_PORT": "0", "AIP_STORAGE_URI": bucket.url("artifacts"),
           "STORAGE_EMULATOR_HOST": storage.endpoint.removeprefix("http://"), "AIP_HEALTH_ROUTE": "/health",
           "AIP_PREDICT_ROUTE": "/predict"}
    with Server(["--storage-anonymous", f"--model-cache-dir={tmp_path / 'cache'}"], env=env, services=("Vertex AI",)) as s:
        import platforms
        port = s.ports["Vertex AI"]
        status, _, _ = platforms.request(port, "GET", "/health")
        assert status == 200
        body = json.dumps({"instances": [{"a": [1, 1, 1, 1], "b": [2, 2, 2, 2]}]}).encode()
        status, _, reply = platforms.request(port, "POST", "/predict", body, {"Content-Type": "application/json"})
        assert status == 200, reply
        assert json.loads(reply)["predictions"][0]["y"] == [3, 3, 3, 3]


def test_soak_version_swaps_under_load_fail_nothing(bucket, tmp_path):
    """Clients send requests without pause while versions are swapped many times: no request
    fails, and every answer comes from a whole, ready version (its numbers match its name)."""
    swaps = int(os.environ.get("FERRY_SOAK_SWAPS", "6"))
    upload_version(bucket, "repo", tmp_path, 1)
    with start(bucket, "repo", tmp_path, "--model-control-mode=poll", "--repository-poll-secs=1") as s:
        stop = threading.Event()
        failures, seen = [], {}

        def client_loop(key, make, module):
            client = make()
            versions = seen.setdefault(key, [])
            while not stop.is_set():
                try:
                    named, computed = served_version(client, module)
                    if named != computed:
                        failures.append(f"{key}: response names version {named} but computed by {computed}")
                    versions.append(named)
                except Exception as e:  # noqa: BLE001 - every failure is the finding
                    failures.append(f"{key}: {e}")

        threads = [threading.Thread(target=client_loop, args=(f"http{i}", s.client, httpclient)) for i in range(2)]
        threads.append(threading.Thread(target=client_loop, args=("grpc", s.grpc_client, grpcclient)))
        for t in threads:
            t.start()
        try:
            for v in range(2, swaps + 2):
                upload_version(bucket, "repo", tmp_path, v)
                wait_for(lambda v=v: all(vs and vs[-1] == v for vs in seen.values()), f"every client to reach version {v}")
                bucket.delete_prefix(f"repo/{NAME}/{v - 1}/")
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert failures == [], failures[:5]
        for key, versions in seen.items():
            assert versions == sorted(versions), f"{key} went back to an older version"
            assert set(versions) == set(range(1, swaps + 2)), f"{key} saw {sorted(set(versions))}"
        total = sum(len(v) for v in seen.values())
        print(f"soak: {swaps} swaps, {total} requests, none failed")
        assert total > 100
        assert "failed to load" not in s.log()


@pytest.mark.parametrize("form", ["s3://{host}/{bucket}/{prefix}", "s3://http://{host}/{bucket}/{prefix}"])
def test_an_s3_compatible_store_named_in_the_url_as_triton_writes_it(tmp_path, form):
    storage = StorageServer("s3")
    try:
        bucket = storage.bucket("triton-form")
        upload_version(bucket, "repo", tmp_path, 1)
        url = form.format(host=bucket.endpoint.removeprefix("http://"), bucket=bucket.name, prefix="repo")
        # No --s3-endpoint: the URL alone says where the store is.
        with Server(["--model-repository", url, "--storage-retries=1", f"--model-cache-dir={tmp_path / 'cache'}"],
                    env=bucket.server_env()) as s:
            assert served_version(s.client()) == (1, 1)
    finally:
        storage.stop()


def no_aws_credentials(tmp_path):
    return {"AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "", "AWS_PROFILE": "",
            "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
            "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": "us-east-1"}


def test_triton_cloud_credential_path_gives_each_prefix_its_keys(tmp_path):
    storage = StorageServer("s3")
    try:
        bucket = storage.bucket("cred-file")
        upload_version(bucket, "repo", tmp_path, 1)
        args = ["--model-repository", bucket.url("repo"), *bucket.server_args(), f"--model-cache-dir={tmp_path / 'c'}"]
        env = no_aws_credentials(tmp_path)
        # Without the file nothing in the environment signs for the bucket.
        s = Server(args, env=env, expect_exit=True)
        assert s.wait_exit() != 0 and "no AWS credentials" in s.log(), s.log()
        # The longest matching name wins: the bucket's own entry, not the "" default.
        creds = tmp_path / "cloud_credential.json"
        creds.write_text(json.dumps({"s3": {
            "": {"key_id": "", "secret_key": "", "region": "", "session_token": "", "profile": "no-such-profile"},
            f"s3://{bucket.name}": {"key_id": "testing", "secret_key": "testing", "region": "us-east-1",
                                    "session_token": "", "profile": ""}}}))
        with Server(args, env={**env, "TRITON_CLOUD_CREDENTIAL_PATH": str(creds)}) as s:
            assert served_version(s.client()) == (1, 1)
        # A file that is not Triton's format stops the start with the file's name, no key echoed.
        creds.write_text(json.dumps({"s3": {"": {"key": "SECRET-VALUE"}}}))
        s = Server(args, env={**env, "TRITON_CLOUD_CREDENTIAL_PATH": str(creds)}, expect_exit=True)
        assert s.wait_exit() != 0
        assert "TRITON_CLOUD_CREDENTIAL_PATH" in s.log() and str(creds) in s.log(), s.log()
        assert "SECRET-VALUE" not in s.log()
    finally:
        storage.stop()
