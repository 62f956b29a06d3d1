"""The agents' spans from Python over OTLP (docs/tracing.md): a child process moves one room
with both agents and `OTEL_EXPORTER_OTLP_ENDPOINT` pointing at an OTLP/HTTP receiver this test
starts; the room's spans arrive, each side's under the `traceparent` its engine passed. Without
the variable nothing is built: no exporter, no export thread."""

import http.server
import os
import subprocess
import sys
import textwrap
import threading

import pytest

# One room with both agents in one process, each side given its engine's request span.
CHILD = textwrap.dedent(
    """
    import os, sys, threading
    import numpy as np
    import kvbridge

    PAGE, ROW, LAYERS, PAGES = 16, 576, 2, 8
    ITEM = PAGE * ROW
    d = lambda role: kvbridge.PeerDescriptor.mla(role, PAGE, LAYERS, ROW)
    server = kvbridge.BootstrapServer()
    pe, de = kvbridge.Engine("loopback"), kvbridge.Engine("loopback")
    p_kv = [pe.allocate(PAGES * ITEM) for _ in range(LAYERS)]
    d_kv = [de.allocate(PAGES * ITEM) for _ in range(LAYERS)]
    prefill = kvbridge.PrefillAgent(pe, d("prefill"), p_kv, bootstrap_addr=server.addr)
    decode = kvbridge.DecodeAgent(de, d("decode"), d_kv)
    prefill.create_room(7, traceparent=os.environ.get("PREFILL_PARENT"))
    decode.receive(7, server.addr, [5, 0], traceparent=os.environ.get("DECODE_PARENT"))
    assert prefill.wait_ready(7, timeout=60.0) == 0
    prefill.send_chunk(7, [4, 2], 2 * PAGE, last=True)
    assert decode.wait(7, timeout=60.0) == kvbridge.KVPoll.Success
    assert prefill.wait(7, timeout=60.0) == kvbridge.KVPoll.Success
    decode.clear(7)
    prefill.clear(7)
    threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip()
                     for t in os.listdir("/proc/self/task"))
    print("exporter", kvbridge.traces_exporter())
    print("threads", ",".join(threads))
    for x in (prefill, decode, pe, de, server):
        x.close()
    # The spans are flushed by the atexit hook.
    """
)

TRACE = "0000000000000000aaaaaaaaaaaaaaaa"
PREFILL_PARENT = f"00-{TRACE}-1111111111111111-01"
DECODE_PARENT = f"00-{TRACE}-2222222222222222-01"


def _varint(buf, i):
    shift = value = 0
    while True:
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def _fields(buf):
    """A protobuf message's fields as (number, value): bytes for length-delimited ones, ints
    for varints (the only wire types OTLP's span messages use besides fixed64 times)."""
    i, out = 0, []
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = int.from_bytes(buf[i : i + 8], "little"), i + 8
        elif wire == 2:
            n, i = _varint(buf, i)
            value, i = bytes(buf[i : i + n]), i + n
        elif wire == 5:
            value, i = int.from_bytes(buf[i : i + 4], "little"), i + 4
        else:
            raise ValueError(f"wire type {wire} in an OTLP message")
        out.append((number, value))
    return out


def _attrs(span_fields):
    attrs = {}
    for number, kv in span_fields:
        if number != 9:  # Span.attributes
            continue
        kv = dict(_fields(kv))
        any_value = dict(_fields(kv.get(2, b"")))
        value = any_value.get(1)  # string_value
        attrs[kv[1].decode()] = value.decode() if value is not None else any_value.get(3)
    return attrs


def decode_export(body):
    """ExportTraceServiceRequest -> one dict per span (name, ids as hex, attributes)."""
    spans = []
    for number, rs in _fields(body):
        if number != 1:  # resource_spans
            continue
        for n2, ss in _fields(rs):
            if n2 != 2:  # scope_spans
                continue
            for n3, span in _fields(ss):
                if n3 != 2:  # spans
                    continue
                f = _fields(span)
                one = dict(f)
                spans.append(
                    {
                        "trace": one[1].hex(),
                        "id": one[2].hex(),
                        "parent": one.get(4, b"").hex(),
                        "name": one[5].decode(),
                        "links": [dict(_fields(v))[2].hex() for k, v in f if k == 13],
                        "attrs": _attrs(f),
                        # Span.status: code 1 OK, 2 ERROR (0: unset), and its message.
                        "status": dict(_fields(one.get(15, b""))).get(3, 0),
                        "status_message": dict(_fields(one.get(15, b""))).get(2, b"").decode(),
                    }
                )
    return spans


@pytest.fixture
def receiver():
    """An OTLP/HTTP receiver on 127.0.0.1: every POST /v1/traces decoded and kept."""
    spans, paths = [], []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["content-length"]))
            paths.append((self.path, self.headers["content-type"]))
            spans.extend(decode_export(body))
            self.send_response(200)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], spans, paths
    server.shutdown()
    server.server_close()


def run_child(extra_env, code=CHILD):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(
        NO_PROXY="127.0.0.1",
        PREFILL_PARENT=PREFILL_PARENT,
        DECODE_PARENT=DECODE_PARENT,
        OTEL_BSP_SCHEDULE_DELAY="100",
        **extra_env,
    )
    env.pop("HTTP_PROXY", None)
    env.pop("http_proxy", None)
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    return lines["exporter"], lines["threads"].split(","), out.stderr


def test_the_agents_spans_reach_an_otlp_receiver_under_the_engines_traceparent(receiver):
    port, spans, paths = receiver
    exporter, threads, stderr = run_child({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"})
    assert exporter == "http/protobuf"
    assert any(t.startswith("OpenTelemetry") for t in threads), threads
    assert paths and all(p == ("/v1/traces", "application/x-protobuf") for p in paths), paths
    rooms = {s["attrs"]["side"]: s for s in spans if s["name"] == "kv_room"}
    assert set(rooms) == {"prefill", "decode"}, (spans, stderr)
    assert rooms["decode"]["parent"] == "2222222222222222"
    assert rooms["prefill"]["parent"] == "1111111111111111"
    assert rooms["prefill"]["links"] == [rooms["decode"]["id"]]
    for s in spans:
        if s["name"] != "kv_register":
            assert s["trace"] == TRACE, s
    by_id = {s["id"]: s for s in spans}
    chunks = [s for s in spans if s["name"] == "kv_chunk"]
    assert len(chunks) == 1 and by_id[chunks[0]["parent"]] is rooms["prefill"]
    receives = [s for s in spans if s["name"] == "kv_receive"]
    assert len(receives) == 1 and by_id[receives[0]["parent"]] is rooms["decode"]


# Engine writes of an engine that opens no rooms (the SGLang plugin's): one that lands, one
# refused at post, one cancelled before it could land, each under the caller's traceparent.
WRITES = textwrap.dedent(
    """
    import os
    import numpy as np
    import kvbridge

    parent = os.environ["PREFILL_PARENT"]
    a, b = kvbridge.Engine("loopback"), kvbridge.Engine("loopback")
    peer = a.connect(b.local_descriptor())
    src, dst = a.allocate(1 << 20), b.allocate(1 << 20)
    op = lambda n: np.array([(src.region, 0, dst.region, 0, n)], dtype=np.uint64)
    assert a.write(peer, op(4096), traceparent=parent, room=7).wait(timeout=60.0)
    try:
        a.write(peer, op(2 << 20), traceparent=parent, room=8)
        raise SystemExit("a write past the region's end was posted")
    except kvbridge.KvbridgeError as e:
        print("refused", type(e).__name__)
    t = a.write(peer, op(1 << 20), traceparent=parent, room=9)
    print("cancelled", t.cancel())
    print("exporter", kvbridge.traces_exporter())
    print("threads", "")  # run_child reads the line
    for x in (a, b):
        x.close()
    """
)


def test_engine_writes_have_a_span_each_under_the_callers_traceparent(receiver):
    """The span an engine's caller (the SGLang plugin) gets per write: parented to the
    traceparent it passed, with the room, the bytes and the transport, and the failure's cause
    as the status when the write was refused or cancelled."""
    port, spans, _ = receiver
    exporter, _, stderr = run_child({"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{port}"}, WRITES)
    assert exporter == "http/protobuf"
    # Integer attributes: u64 values, which OpenTelemetry carries as strings where i64 ends.
    writes = {int(s["attrs"]["room"]): s for s in spans if s["name"] == "kv_write"}
    assert set(writes) == {7, 8, 9}, (spans, stderr)
    for w in writes.values():
        assert (w["trace"], w["parent"]) == (TRACE, "1111111111111111"), w
        assert w["attrs"]["transport"] == "loopback" and int(w["attrs"]["ops"]) == 1, w
    landed, refused, cancelled = writes[7], writes[8], writes[9]
    assert int(landed["attrs"]["bytes"]) == 4096 and landed["status"] == 1, landed
    assert refused["status"] == 2 and refused["attrs"]["error.type"] == "transfer_error", refused
    assert str(2 << 20) in refused["status_message"], refused
    # A cancel may come after the bytes landed; the span says which.
    if cancelled["status"] == 2:
        assert cancelled["attrs"]["error.type"] == "aborted", cancelled
    else:
        assert cancelled["status"] == 1, cancelled


def test_without_the_variable_there_is_no_exporter_and_no_export_thread(receiver):
    port, spans, _ = receiver
    exporter, threads, _ = run_child({})
    assert exporter == "None"
    assert not any(t.startswith("OpenTelemetry") or t.startswith("kvbridge-otlp") for t in threads), threads
    assert spans == []


def test_a_malformed_traceparent_is_refused_with_the_form_expected():
    import kvbridge

    server = kvbridge.BootstrapServer()
    engine = kvbridge.Engine("loopback")
    kv = [engine.allocate(16 * 576 * 8)]
    agent = kvbridge.PrefillAgent(
        engine, kvbridge.PeerDescriptor.mla("prefill", 16, 1, 576), kv, bootstrap_addr=server.addr
    )
    try:
        with pytest.raises(kvbridge.InvalidArgumentError, match="not a W3C traceparent"):
            agent.create_room(1, traceparent="00-xyz-01")
    finally:
        agent.close()
        engine.close()
        server.close()
