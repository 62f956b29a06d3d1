"""The plugin's spans in SGLang's own traces: a prefill and a decode, real SGLang 0.5.23 servers
with ``--enable-trace --trace-modules request,kvbridge``, export their spans over OTLP/HTTP to a
receiver this test starts (SGLang's from its SDK, kvbridge's from the package's exporter, both
to the same endpoint). One request's ``kv_write`` spans, one per write the plugin posted, must
be in the trace of SGLang's ``Sender Req`` span for that bootstrap room, under its transfer
worker's slice, with the room, the bytes and the transport on them (docs/tracing.md, "SGLang").

The receiver decodes with the official OTLP definitions (``opentelemetry-proto``, installed
with SGLang's ``tracing`` extra, tests/serving/requirements-serving.txt).
"""

from __future__ import annotations

import http.server
import os
import random
import threading
import time

import pytest

import servers
import tiny_models

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.skipif(servers.unavailable() is not None, reason=str(servers.unavailable())),
]

try:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
except ImportError:  # SGLang's tracing extra is not installed
    ExportTraceServiceRequest = None

SPANS_S = 60.0  # how long the test waits for the spans after the request answered


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


@pytest.fixture
def receiver():
    """An OTLP/HTTP receiver on 127.0.0.1; every span posted to /v1/traces kept as a dict."""
    spans, lock = [], threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["content-length"]))
            request = ExportTraceServiceRequest()
            request.ParseFromString(body)
            got = []
            for rs in request.resource_spans:
                service = {a.key: _value(a.value) for a in rs.resource.attributes}.get("service.name")
                for ss in rs.scope_spans:
                    for s in ss.spans:
                        got.append(
                            {
                                "service": service,
                                "name": s.name,
                                "trace": s.trace_id.hex(),
                                "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(),
                                "attrs": {a.key: _value(a.value) for a in s.attributes},
                                "status": s.status.code,
                            }
                        )
            with lock:
                spans.extend(got)
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    def snapshot():
        with lock:
            return list(spans)

    yield server.server_address[1], snapshot
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def _traced(name, path, log_dir, port, mode):
    endpoint = f"http://127.0.0.1:{port}"
    return servers.Server(
        name, path, log_dir, mode=mode,
        args=(
            "--enable-trace", "--trace-modules", "request,kvbridge",
            "--otlp-traces-endpoint", f"{endpoint}/v1/traces",
        ),
        env={
            # SGLang's exporter (grpc unless told) and kvbridge's, to the same receiver.
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "SGLANG_OTLP_EXPORTER_SCHEDULE_DELAY_MILLIS": "200",
            "NO_PROXY": "127.0.0.1",
        },
    )


def _ancestors(span, by_id):
    """The chain of parents of `span` that the receiver holds, nearest first."""
    chain = []
    while span["parent"] in by_id and len(chain) < 64:
        span = by_id[span["parent"]]
        chain.append(span)
    return chain


@pytest.mark.skipif(ExportTraceServiceRequest is None, reason="SGLang's tracing extra (opentelemetry-proto) is not installed")
def test_the_plugins_writes_are_spans_in_sglangs_sender_trace(receiver, tmp_path):
    port, spans = receiver
    log_dir = os.environ.get("KVBRIDGE_SERVING_LOG_DIR") or str(tmp_path / "logs")
    path = tiny_models.make("llama", str(tmp_path / "models"))
    prefill = _traced("traced-prefill", path, log_dir, port, "prefill")
    decode = _traced("traced-decode", path, log_dir, port, "decode")
    router = servers.Router(prefill, decode)
    room = servers.next_room()
    try:
        servers.start_all([prefill, decode])
        rng = random.Random(11)
        router.generate([rng.randrange(3, 380) for _ in range(100)], max_new_tokens=4, room=room)
        end = time.monotonic() + SPANS_S
        while True:
            got = spans()
            senders = [
                s for s in got
                if s["name"].startswith("Sender Req") and s["attrs"].get("bootstrap_room") == hex(room)
            ]
            writes = [s for s in got if s["name"] == "kv_write" and s["attrs"].get("room") in (room, str(room))]
            if senders and writes and all(w["parent"] in {s["id"] for s in got} for w in writes):
                break
            assert time.monotonic() < end, (
                f"within {SPANS_S:.0f} s the receiver got {len(got)} spans, "
                f"{len(senders)} Sender Req of room {hex(room)} and {len(writes)} kv_write of it: "
                f"{sorted({s['name'] for s in got})}; logs in {log_dir}"
            )
            time.sleep(0.5)
    finally:
        router.close()
        servers.stop_all([prefill, decode])

    (sender,) = senders
    assert sender["attrs"]["module"] == "sglang::kvbridge", sender
    by_id = {s["id"]: s for s in got}
    for w in writes:
        # One trace with SGLang's sender, under the transfer worker's slice of it.
        assert w["trace"] == sender["trace"], (w, sender)
        chain = _ancestors(w, by_id)
        assert chain and chain[0]["name"] == "mooncake_worker_send", chain
        assert sender in chain, chain
        assert w["service"] == "kvbridge-python" and w["attrs"]["transport"] == "tcp", w
        assert w["status"] == 1, w  # OK
    assert sum(int(w["attrs"]["bytes"]) for w in writes) > 0, writes
