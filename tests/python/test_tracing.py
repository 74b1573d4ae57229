"""OpenTelemetry traces into a real OTLP receiver (gRPC and HTTP) run by the test, the caller's
traceparent continued, trace settings applied at run time, and JSON logs."""
import http.server
import json
import os
import queue
import threading
import time
from concurrent import futures

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from conftest import EXAMPLES
from ferry_server import Server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """Keeps every span it receives, as {hex span id: span}."""

    def __init__(self):
        self.spans = {}
        self.lock = threading.Lock()

    def keep(self, request):
        with self.lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        self.spans[s.span_id.hex()] = s

    def Export(self, request, context):  # noqa: N802 - the gRPC method name
        self.keep(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def wait_for(self, predicate, timeout=15):
        deadline = time.time() + timeout
        while time.time() < deadline:
            with self.lock:
                found = [s for s in self.spans.values() if predicate(s)]
            if found:
                return found
            time.sleep(0.1)
        return []


@pytest.fixture
def grpc_collector():
    collector = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield collector, port
    server.stop(0)


@pytest.fixture
def http_collector():
    collector = Collector()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            collector.keep(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield collector, httpd.server_address[1]
    httpd.shutdown()


def inputs(lib):
    a = np.ones((1, 16), dtype=np.int32)
    return [lib.InferInput(n, [1, 16], "INT32").set_data_from_numpy(a) for n in ("INPUT0", "INPUT1")]


def check_request_trace(collector, trace_id):
    infer = collector.wait_for(lambda s: s.trace_id.hex() == trace_id and s.name == "infer")
    assert len(infer) == 1, "one span for the request"
    infer = infer[0]
    assert infer.parent_span_id.hex() == PARENT_ID, "the caller's trace continues"
    children = collector.wait_for(lambda s: s.trace_id.hex() == trace_id and s.parent_span_id == infer.span_id)
    names = {s.name for s in children}
    assert {"queue", "compute", "response"} <= names, names
    compute = next(s for s in children if s.name == "compute")
    assert infer.span_id in {link.span_id for link in compute.links}, "the batch links to its requests"
    attrs = {a.key: a.value for a in infer.attributes}
    assert attrs["model"].string_value == "simple"


def test_traces_over_otlp_grpc(grpc_collector):
    collector, port = grpc_collector
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}", "OTEL_SERVICE_NAME": "ferry-test"}
    with Server(["--model-repository", EXAMPLES, "--trace-config=rate=1"], env=env) as s:
        s.client().infer("simple", inputs(httpclient), headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        check_request_trace(collector, TRACE_ID)
        other = "1" * 32
        s.grpc_client().infer("simple", inputs(grpcclient), headers={"traceparent": f"00-{other}-{PARENT_ID}-01"})
        check_request_trace(collector, other)


def test_traces_over_otlp_http_and_settings_at_run_time(http_collector):
    collector, port = http_collector
    args = ["--model-repository", EXAMPLES, "--trace-config=mode=opentelemetry",
            f"--trace-config=opentelemetry,url=127.0.0.1:{port}/v1/traces", "--trace-config=rate=1"]
    with Server(args) as s:
        client = s.client()
        client.infer("simple", inputs(httpclient), headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
        check_request_trace(collector, TRACE_ID)
        assert client.get_trace_settings()["trace_mode"] == "opentelemetry"
        client.update_trace_settings(settings={"trace_level": ["OFF"]})
        before = len(collector.spans)
        client.infer("simple", inputs(httpclient))
        time.sleep(1.5)  # the exporter sends every 0.5 s; nothing may arrive
        assert len(collector.spans) == before, "trace_level OFF stops sampled tracing"
        client.update_trace_settings(settings={"trace_level": ["TIMESTAMPS"]})
        client.infer("simple", inputs(httpclient), request_id="sampled")
        assert collector.wait_for(lambda s: s.name == "infer" and any(
            a.key == "request_id" and a.value.string_value == "sampled" for a in s.attributes))


def test_dead_collector_blocks_neither_start_nor_stop():
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    s = Server(["--model-repository", EXAMPLES, "--trace-config=rate=1"], env=env)
    s.client().infer("simple", inputs(httpclient))
    started = time.time()
    s.stop()
    assert s.proc.returncode == 0 and time.time() - started < 10


def test_json_logs_carry_severity_message_and_fields():
    with Server(["--model-repository", EXAMPLES, "--log-format=json"]) as s:
        lines = [l for l in s.log().splitlines() if l.startswith("{")]
        assert lines, s.log()
        docs = [json.loads(l) for l in lines]
        assert all({"timestamp", "severity", "message"} <= set(d) for d in docs)
        ready = [d for d in docs if d["message"] == "model version ready"]
        served = {m for m in os.listdir(EXAMPLES) if os.path.isfile(os.path.join(EXAMPLES, m, "config.pbtxt"))}
        assert ready and ready[0]["severity"] == "INFO" and ready[0]["model"] in served
        assert ready[0]["timestamp"].endswith("Z")
