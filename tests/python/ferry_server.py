"""Starts the real ferry binary on 127.0.0.1 port 0 and waits for it; used by every test."""
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BINARY = os.environ.get("FERRY_BIN", os.path.join(ROOT, "target", "debug", "ferry"))
LISTENING = re.compile(r"(HTTP KServe v2|gRPC KServe v2|Prometheus metrics|Vertex AI|SageMaker) service listening on ([\d.]+):(\d+)")


def wait_for(condition, what, timeout=60):
    """Waits until `condition()` is true (polled; the time taken is never asserted)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


class Server:
    """One ferry process. `args` are extra `ferry serve` flags; `env` extra environment."""

    def __init__(self, args=(), env=None, wait_ready=True, timeout=60, expect_exit=False,
                 services=("HTTP KServe v2", "gRPC KServe v2")):
        self.services = set(services)
        full_env = dict(os.environ)
        full_env.update(env or {})
        self.cmd = [BINARY, "serve", "--http-address=127.0.0.1", "--http-port=0", "--grpc-port=0", "--metrics-port=0", *args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full_env, text=True)
        self.lines = []
        self.ports = {}
        self._seen = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        if expect_exit:
            return
        try:
            self._wait_port(timeout)
            if wait_ready:
                self.wait_ready(timeout)
        except BaseException:
            # A server that never came up is not left running behind the failed test.
            self.proc.kill()
            self.proc.wait()
            raise

    def _read(self):
        for line in self.proc.stdout:
            with self._seen:
                self.lines.append(line)
                m = LISTENING.search(line)
                if m:
                    self.ports[m.group(1)] = int(m.group(3))
                self._seen.notify_all()
        with self._seen:
            self._seen.notify_all()

    def _wait_port(self, timeout):
        deadline = time.time() + timeout
        with self._seen:
            while not self.services <= set(self.ports):
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"ferry did not start: {self.cmd}\n{self.log()}")
                self._seen.wait(0.1)

    @property
    def port(self):
        return self.ports.get("HTTP KServe v2")

    @property
    def grpc_port(self):
        return self.ports.get("gRPC KServe v2")

    @property
    def metrics_port(self):
        return self.ports.get("Prometheus metrics")

    def metrics(self):
        """The /metrics text."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            return r.read().decode()

    @property
    def url(self):
        return f"127.0.0.1:{self.port}"

    def client(self):
        return httpclient.InferenceServerClient(self.url)

    @property
    def grpc_url(self):
        return f"127.0.0.1:{self.grpc_port}"

    def grpc_client(self):
        return grpcclient.InferenceServerClient(self.grpc_url)

    def wait_log(self, text, timeout=10):
        """Waits until `text` appears in the output (lines are read on another thread)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if text in self.log():
                return True
            time.sleep(0.02)
        return False

    def log(self):
        with self._seen:
            return "".join(self.lines)

    def status(self, path):
        try:
            with urllib.request.urlopen(f"http://{self.url}{path}", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    def wait_ready(self, timeout=60):
        """Waits until start-up loading is over (ready, or live but some model failed)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ferry exited with {self.proc.returncode}:\n{self.log()}")
            if "ferry is serving" in self.log():
                return
            time.sleep(0.05)
        raise RuntimeError(f"ferry was not serving after {timeout}s:\n{self.log()}")

    def wait_exit(self, timeout=60):
        """Waits for the process to end (and its output to be read); returns its exit code."""
        code = self.proc.wait(timeout)
        self._reader.join(5)
        return code

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
