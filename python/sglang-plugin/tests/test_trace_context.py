"""The `traceparent` each plugin write carries: that of SGLang 0.5.23's own span for the chunk
(`TraceReqContext`, sglang/srt/observability/trace.py), read on the transfer worker's thread;
none where SGLang traces nothing; and never a failed write because of tracing
(docs/tracing.md, "SGLang"). The real servers' trace is tests/serving/test_tracing.py."""

import pytest

pytestmark = pytest.mark.sglang


@pytest.fixture
def sdk_tracer(monkeypatch):
    """SGLang's tracing module as `process_tracing_init` leaves it, with an SDK tracer whose
    spans stay in memory (no exporter, no endpoint)."""
    sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="SGLang's tracing extra is not installed")
    from sglang.srt.observability import trace as sglang_trace

    provider = sdk.TracerProvider()
    monkeypatch.setattr(sglang_trace, "opentelemetry_initialized", True)
    monkeypatch.setattr(sglang_trace, "tracer", provider.get_tracer("test"), raising=False)
    monkeypatch.setattr(sglang_trace, "global_trace_modules", None)
    return sglang_trace


def _w3c(span) -> str:
    sc = span.get_span_context()
    return f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"


def test_the_innermost_open_span_of_sglangs_sender_context_is_the_parent(sdk_tracer):
    from kvbridge_sglang.conn import sglang_traceparent

    ctx = sdk_tracer.TraceReqContext(rid=hex(77), bootstrap_room=77, role="Sender", module_name="kvbridge")
    ctx.trace_req_start()
    thread_span = ctx.thread_context.thread_span
    assert sglang_traceparent(ctx) == _w3c(thread_span)
    ctx.trace_slice_start("mooncake_worker_send", 1)
    slice_span = ctx.thread_context.cur_slice_stack[-1].span
    got = sglang_traceparent(ctx)
    assert got == _w3c(slice_span) and got != _w3c(thread_span)
    ctx.trace_slice_end("mooncake_worker_send", 1)
    ctx.trace_req_finish()


def test_no_parent_where_sglang_traces_nothing(sdk_tracer):
    from kvbridge_sglang.conn import sglang_traceparent

    assert sglang_traceparent(None) is None
    assert sglang_traceparent(sdk_tracer.TraceNullContext()) is None
    # kvbridge left out of --trace-modules: SGLang's context is off for this module.
    sdk_tracer.global_trace_modules = ["request"]
    off = sdk_tracer.TraceReqContext(rid="1", bootstrap_room=1, role="Sender", module_name="kvbridge")
    assert sglang_traceparent(off) is None


def test_an_unreadable_context_gives_the_write_no_parent_and_no_error():
    from kvbridge_sglang import conn

    class Broken:
        tracing_enable = True

        @property
        def thread_context(self):
            raise RuntimeError("an SGLang whose context has other fields")

    conn._CHUNK.room, conn._CHUNK.trace_ctx = 5, Broken()
    try:
        assert conn.KvbridgeKVManager._write_context() == (5, None)
    finally:
        conn._CHUNK.room, conn._CHUNK.trace_ctx = None, None
