"""The response cache through the real server: hits and misses under concurrent load, no false
hits, the byte bound, single flight, opt-in per model, and the Redis tier shared by two ferry
processes (Debian's redis-server, from scripts/redis.sh) including a slow and a dead Redis."""
import json
import os
import subprocess
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

import models
from buckets import free_port
from ferry_server import Server
from test_metrics import parse, value

IO = """
input [ { name: "a" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "b" data_type: TYPE_FP32 dims: [ 4 ] } ]
output [ { name: "y" data_type: TYPE_FP32 dims: [ 4 ] }, { name: "z" data_type: TYPE_FP32 dims: [ 4 ] } ]
"""
CACHED = "max_batch_size: 8\nresponse_cache { enable: true }\n" + IO
LOCAL = ["--cache-config", "local,size=1048576"]


def add_mul(repo, name, config=CACHED, versions=(1,)):
    models.add_mul(repo, name, versions=versions, config=f'name: "{name}"\n' + config)


def inputs(lib, a, b=None):
    a = np.asarray(a, dtype=np.float32).reshape(1, 4)
    b = a if b is None else np.asarray(b, dtype=np.float32).reshape(1, 4)
    return [lib.InferInput(n, [1, 4], "FP32").set_data_from_numpy(v) for n, v in (("a", a), ("b", b))]


def stats(s, model, version=""):
    return s.client().get_inference_statistics(model, version)["model_stats"][0]


def raw_infer(s, model, body):
    req = urllib.request.Request(f"http://{s.url}/v2/models/{model}/infer", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


def test_repeats_are_hits_under_concurrent_load(fresh_repo):
    add_mul(fresh_repo, "cached")
    with Server(["--model-repository", fresh_repo, *LOCAL]) as s:
        distinct, repeats = 20, 5
        client = httpclient.InferenceServerClient(s.url, concurrency=16)
        work = [k for _ in range(repeats) for k in range(distinct)]
        pending = [(k, client.async_infer("cached", inputs(httpclient, [k, k + 1, k + 2, k + 3]))) for k in work]
        for k, p in pending:
            r = p.get_result()
            a = np.array([[k, k + 1, k + 2, k + 3]], dtype=np.float32)
            np.testing.assert_array_equal(r.as_numpy("y"), a + a)
            np.testing.assert_array_equal(r.as_numpy("z"), a * a)
        st = stats(s, "cached")
        n = distinct * repeats
        assert st["inference_stats"]["cache_miss"]["count"] == distinct
        assert st["inference_stats"]["cache_hit"]["count"] == n - distinct
        assert st["inference_count"] == distinct, "only misses reach the model"
        assert st["inference_stats"]["success"]["count"] == n
        assert st["inference_stats"]["queue"]["count"] == n
        assert st["inference_stats"]["cache_hit"]["ns"] > 0 and st["inference_stats"]["cache_miss"]["ns"] > 0
        # gRPC shares the cache: a repeat of an HTTP request is a hit.
        r = s.grpc_client().infer("cached", inputs(grpcclient, [0, 1, 2, 3]))
        np.testing.assert_array_equal(r.as_numpy("z"), np.array([[0, 1, 4, 9]], dtype=np.float32))
        assert stats(s, "cached")["inference_stats"]["cache_hit"]["count"] == n - distinct + 1
        values, types = parse(s.metrics())
        labels = {"model": "cached", "version": "1"}
        assert value(values, "nv_cache_num_hits_per_model", **labels) == n - distinct + 1
        assert value(values, "nv_cache_num_misses_per_model", **labels) == distinct
        assert value(values, "nv_cache_hit_duration_per_model", **labels) > 0
        assert value(values, "nv_inference_request_success", **labels) == n + 1
        assert value(values, "nv_inference_count", **labels) == distinct
        assert value(values, "ferry_cache_local_entries") == distinct
        assert types["ferry_cache_local_bytes"] == "gauge"


def test_a_hit_is_byte_for_byte_the_miss(fresh_repo):
    add_mul(fresh_repo, "cached")
    with Server(["--model-repository", fresh_repo, *LOCAL]) as s:
        body = {"id": "same", "inputs": [{"name": n, "shape": [1, 4], "datatype": "FP32", "data": [0.5, 1, 2, 3]}
                                         for n in ("a", "b")]}
        miss = raw_infer(s, "cached", body)
        hit = raw_infer(s, "cached", body)
        assert hit == miss
        body["id"] = "other"
        renamed = json.loads(raw_infer(s, "cached", body))
        assert renamed["id"] == "other", "a hit answers with the request's own id"
        assert stats(s, "cached")["inference_stats"]["cache_hit"]["count"] == 2


def test_no_false_hits(fresh_repo):
    add_mul(fresh_repo, "versions", config=CACHED + "version_policy { all { } }\n", versions=(1, 2))
    models.identity(fresh_repo, "echo", "FP32")
    with open(os.path.join(fresh_repo, "echo", "config.pbtxt"), "a") as f:
        f.write("response_cache { enable: true }\n")
    with Server(["--model-repository", fresh_repo, *LOCAL]) as s:
        c = s.client()
        a = [1.0, 2.0, 3.0, 4.0]
        y1 = c.infer("versions", inputs(httpclient, a), model_version="1").as_numpy("y")
        y2 = c.infer("versions", inputs(httpclient, a), model_version="2").as_numpy("y")
        np.testing.assert_array_equal(y2, y1 + 1, "version 2 computed, not version 1's stored answer")
        # One flipped bit in one float.
        flipped = np.array(a, dtype=np.float32)
        flipped.view(np.uint32)[3] ^= 1
        z = c.infer("versions", inputs(httpclient, flipped, a), model_version="1").as_numpy("z")
        np.testing.assert_array_equal(z, (flipped * np.array(a, dtype=np.float32)).reshape(1, 4))
        # Fewer outputs asked for: a different response.
        only_z = c.infer("versions", inputs(httpclient, a), model_version="1",
                         outputs=[httpclient.InferRequestedOutput("z")])
        assert only_z.as_numpy("y") is None and only_z.as_numpy("z") is not None
        # The same bytes in another shape.
        data = np.arange(8, dtype=np.float32)
        for shape in ([1, 8], [2, 4], [4, 2], [8, 1]):
            x = httpclient.InferInput("INPUT0", shape, "FP32").set_data_from_numpy(data.reshape(shape))
            out = c.infer("echo", [x]).as_numpy("OUTPUT0")
            assert list(out.shape) == shape
            np.testing.assert_array_equal(out, data.reshape(shape))
        for name, version in (("versions", "1"), ("versions", "2"), ("echo", "1")):
            assert stats(s, name, version)["inference_stats"]["cache_hit"]["count"] == 0, name
        # ...and a true repeat still hits.
        c.infer("echo", [httpclient.InferInput("INPUT0", [2, 4], "FP32").set_data_from_numpy(data.reshape(2, 4))])
        assert stats(s, "echo")["inference_stats"]["cache_hit"]["count"] == 1


def test_eviction_keeps_the_byte_bound(fresh_repo):
    add_mul(fresh_repo, "cached")
    bound = 4096
    with Server(["--model-repository", fresh_repo, "--cache-config", f"local,size={bound}"]) as s:
        c = s.client()
        for k in range(60):
            c.infer("cached", inputs(httpclient, [k] * 4))
        values, _ = parse(s.metrics())
        used, entries = value(values, "ferry_cache_local_bytes"), value(values, "ferry_cache_local_entries")
        assert value(values, "ferry_cache_local_capacity_bytes") == bound
        assert 0 < used <= bound and 0 < entries < 60
        # The newest is held, the oldest was evicted and runs again.
        c.infer("cached", inputs(httpclient, [59] * 4))
        c.infer("cached", inputs(httpclient, [0] * 4))
        st = stats(s, "cached")["inference_stats"]
        assert (st["cache_hit"]["count"], st["cache_miss"]["count"]) == (1, 61)


def test_identical_concurrent_misses_run_once(fresh_repo):
    # The batcher holds the first request up to 500 ms, so the others arrive while it runs.
    add_mul(fresh_repo, "slow", config=CACHED + "dynamic_batching { max_queue_delay_microseconds: 500000 }\n")
    with Server(["--model-repository", fresh_repo, *LOCAL]) as s:
        n = 16
        client = httpclient.InferenceServerClient(s.url, concurrency=n)
        pending = [client.async_infer("slow", inputs(httpclient, [3, 3, 3, 3])) for _ in range(n)]
        for p in pending:
            np.testing.assert_array_equal(p.get_result().as_numpy("z"), np.full((1, 4), 9, dtype=np.float32))
        st = stats(s, "slow")
        assert st["inference_count"] == 1 and st["execution_count"] == 1, st
        assert st["inference_stats"]["cache_hit"]["count"] == n - 1


def test_the_cache_is_opt_in(fresh_repo):
    add_mul(fresh_repo, "cached")
    add_mul(fresh_repo, "plain", config="max_batch_size: 8\n" + IO)
    with Server(["--model-repository", fresh_repo, *LOCAL]) as s:
        for _ in range(3):
            s.client().infer("plain", inputs(httpclient, [1, 2, 3, 4]))
        st = stats(s, "plain")
        assert st["inference_count"] == 3 and st["inference_stats"]["cache_hit"]["count"] == 0
        values, _ = parse(s.metrics())
        assert ("nv_cache_num_hits_per_model", frozenset({"model": "plain", "version": "1"}.items())) not in values
        assert value(values, "nv_cache_num_hits_per_model", model="cached", version="1") == 0
    # A model asking for the cache on a server without one computes every time.
    with Server(["--model-repository", fresh_repo]) as s:
        for _ in range(3):
            s.client().infer("cached", inputs(httpclient, [1, 2, 3, 4]))
        assert stats(s, "cached")["inference_count"] == 3
        assert s.wait_log("response_cache is enabled in the model's config but the server has no cache")
        text = s.metrics()
        assert "ferry_cache_local_entries" not in text and "nv_cache_num_hits_per_model" not in text


@pytest.mark.parametrize("flags,says", [
    (["--cache-config", "local,size=lots"], "size must be a number of bytes, got 'lots'"),
    (["--cache-config", "redis,port=6379"], "host=<host> is required"),
    (["--cache-config", "redis,host=x", "--cache-config", "redis,colour=blue"], "unknown key 'colour'"),
])
def test_a_bad_cache_config_is_refused(fresh_repo, flags, says):
    s = Server(["--model-repository", fresh_repo, *flags], expect_exit=True)
    assert s.wait_exit() != 0
    assert says in s.log()


class Redis:
    """Debian's redis-server on a free loopback port (REDIS_SERVER from scripts/redis.sh)."""

    def __init__(self, port=None):
        self.server = os.environ.get("REDIS_SERVER")
        self.cli = os.environ.get("REDIS_CLI")
        if not self.server or not self.cli:
            raise RuntimeError("REDIS_SERVER/REDIS_CLI unset: run the suite through scripts/test.sh "
                               "(or `source scripts/redis.sh` first)")
        self.port = port or free_port()
        self.start()

    def start(self):
        self.proc = subprocess.Popen([self.server, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--enable-debug-command", "local"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 30
        while self.call("PING") != "PONG":
            assert time.time() < deadline and self.proc.poll() is None, "redis-server did not start"
            time.sleep(0.05)

    def call(self, *args):
        r = subprocess.run([self.cli, "-p", str(self.port), *args], capture_output=True, text=True)
        return r.stdout.strip()

    def keys(self):
        return [k for k in self.call("KEYS", "ferry:*").splitlines() if k]

    def kill(self):
        self.proc.kill()
        self.proc.wait()

    def config(self, local=True):
        flags = ["--cache-config", f"redis,host=127.0.0.1", "--cache-config", f"redis,port={self.port}"]
        return (LOCAL if local else []) + flags


@pytest.fixture
def redis():
    r = Redis()
    yield r
    r.kill()


def wait_for(condition, timeout=30):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, "condition not reached"
        time.sleep(0.05)


def test_two_servers_share_hits_through_redis(fresh_repo, redis):
    add_mul(fresh_repo, "cached")
    with Server(["--model-repository", fresh_repo, *redis.config()]) as one, \
            Server(["--model-repository", fresh_repo, *redis.config(local=False)]) as two:
        want = one.client().infer("cached", inputs(httpclient, [5, 6, 7, 8])).as_numpy("z")
        wait_for(lambda: len(redis.keys()) == 1)
        got = two.client().infer("cached", inputs(httpclient, [5, 6, 7, 8])).as_numpy("z")
        np.testing.assert_array_equal(got, want)
        st = stats(two, "cached")
        assert st["inference_count"] == 0, "the second server never ran the model"
        assert st["inference_stats"]["cache_hit"]["count"] == 1
        values, _ = parse(two.metrics())
        assert value(values, "ferry_cache_shared_hits_total") == 1
        assert value(values, "ferry_cache_shared_errors_total") == 0
        # A response the second server computes is a hit on the first.
        two.client().infer("cached", inputs(httpclient, [1, 1, 1, 1]))
        wait_for(lambda: len(redis.keys()) == 2)
        one.client().infer("cached", inputs(httpclient, [1, 1, 1, 1]))
        assert stats(one, "cached")["inference_count"] == 1


def test_a_slow_or_dead_redis_never_fails_a_request(fresh_repo, redis):
    add_mul(fresh_repo, "cached")
    with Server(["--model-repository", fresh_repo, *redis.config(local=False)]) as s:
        c = s.client()
        c.infer("cached", inputs(httpclient, [0] * 4))
        wait_for(lambda: len(redis.keys()) == 1)
        # Slow: Redis stops answering for 2 s; lookups give up after 100 ms.
        sleeper = threading.Thread(target=redis.call, args=("DEBUG", "SLEEP", "2"))
        sleeper.start()
        time.sleep(0.2)
        k, until = 1, time.time() + 1.5
        while time.time() < until:
            z = c.infer("cached", inputs(httpclient, [k] * 4)).as_numpy("z")
            np.testing.assert_array_equal(z, np.full((1, 4), k * k, dtype=np.float32))
            k += 1
        sleeper.join()
        values, _ = parse(s.metrics())
        assert value(values, "ferry_cache_shared_errors_total") >= 1
        assert s.wait_log("response cache: Redis")
        # Dead, in the middle of a load.
        failures, done = [], []

        def load(t):
            client = httpclient.InferenceServerClient(s.url)
            for k in range(40):
                try:
                    v = float(t * 100 + k % 10)
                    z = client.infer("cached", inputs(httpclient, [v] * 4)).as_numpy("z")
                    assert z[0, 0] == v * v
                    done.append(1)
                except Exception as e:  # noqa: BLE001 - every failure is reported below
                    failures.append(repr(e))

        with ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(load, t) for t in range(4)]
            time.sleep(0.3)
            redis.kill()
            for f in futures:
                f.result()
        assert failures == [] and len(done) == 160
        # Back again: ferry reconnects and shares again.
        redis.start()
        wait_for(lambda: (c.infer("cached", inputs(httpclient, [77] * 4)) and len(redis.keys()) == 1))
        before = stats(s, "cached")["inference_count"]
        c2 = Server(["--model-repository", fresh_repo, *redis.config(local=False)])
        try:
            c2.client().infer("cached", inputs(httpclient, [77] * 4))
            assert stats(c2, "cached")["inference_count"] == 0
        finally:
            c2.stop()
        assert stats(s, "cached")["inference_count"] == before


def test_an_undecodable_redis_entry_is_a_miss_for_its_key_only(fresh_repo, redis):
    """One bad entry (another writer, a bit flip) costs a miss for that key; the shared tier stays
    on for every other key."""
    add_mul(fresh_repo, "cached")
    with Server(["--model-repository", fresh_repo, *redis.config(local=False)]) as one:
        one.client().infer("cached", inputs(httpclient, [1, 2, 3, 4]))
        one.client().infer("cached", inputs(httpclient, [5, 6, 7, 8]))
        wait_for(lambda: len(redis.keys()) == 2)
        bad = redis.keys()[0]
        redis.call("SET", bad, "not an entry")
        with Server(["--model-repository", fresh_repo, *redis.config(local=False)]) as two:
            c = two.client()
            for a in ([1, 2, 3, 4], [5, 6, 7, 8]):
                z = c.infer("cached", inputs(httpclient, a)).as_numpy("z")
                np.testing.assert_array_equal(z, np.array([a], dtype=np.float32) ** 2)
            assert stats(two, "cached")["inference_count"] == 1, "only the bad key ran the model"
            values, _ = parse(two.metrics())
            assert value(values, "ferry_cache_shared_hits_total") == 1
            # The good entry is served again right away: the tier did not rest.
            c.infer("cached", inputs(httpclient, [9, 9, 9, 9]))
            wait_for(lambda: len(redis.keys()) == 3)
            assert "Redis lookup failed" not in two.log()
