//! The agents' spans as OpenTelemetry records them, in one process on tokio's paused clock: a
//! room's decode and prefill spans are one trace through `transfer_info.traceparent`, and a
//! room that fails (the decode's waiting timeout) ends every span with its cause. Without an
//! OpenTelemetry layer (every other test) nothing is traced and nothing changes.

mod common;

use common::{Request, Spec, bounded, rig};
use kvbridge_coordinator::{PrefillConfig, TraceParent};
use opentelemetry::trace::{SpanId, Status, TraceId, TracerProvider as _};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use std::time::Duration;
use tracing_subscriber::layer::SubscriberExt;

/// An OpenTelemetry layer exporting every ended span to memory, for this thread.
fn otel() -> (
    InMemorySpanExporter,
    SdkTracerProvider,
    tracing::subscriber::DefaultGuard,
) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("test"));
    let guard = tracing::subscriber::set_default(tracing_subscriber::registry().with(layer));
    (exporter, provider, guard)
}

fn attr(s: &SpanData, key: &str) -> Option<String> {
    s.attributes
        .iter()
        .find(|kv| kv.key.as_str() == key)
        .map(|kv| kv.value.to_string())
}

fn one<'a>(spans: &'a [SpanData], name: &str, side: &str) -> &'a SpanData {
    let found: Vec<_> = spans
        .iter()
        .filter(|s| s.name == name && attr(s, "side").as_deref() == Some(side))
        .collect();
    assert_eq!(found.len(), 1, "{name} on the {side}: {found:#?}");
    found[0]
}

#[tokio::test(start_paused = true)]
async fn a_rooms_decode_and_prefill_spans_are_one_trace() {
    let (exporter, _provider, _guard) = otel();
    let r = rig(Spec::mla_one_to_one()).await;
    let req = Request::new(7, 40);
    for out in r.run(&req).await {
        out.unwrap();
    }
    bounded(r.prefills[0].0.wait(7)).await.unwrap();
    r.decodes[0].0.clear(7);
    r.prefills[0].0.clear(7);
    drop(r);
    let spans = exporter.get_finished_spans().unwrap();
    let decode = one(&spans, "kv_room", "decode");
    let prefill = one(&spans, "kv_room", "prefill");
    assert_eq!(
        prefill.span_context.trace_id(),
        decode.span_context.trace_id(),
        "one trace across the PD boundary"
    );
    assert_eq!(prefill.parent_span_id, decode.span_context.span_id());
    assert!(
        prefill.parent_span_is_remote,
        "the parent came over the wire"
    );
    for s in [decode, prefill] {
        assert_eq!(s.status, Status::Ok, "{s:#?}");
        assert_eq!(attr(s, "room").as_deref(), Some("7"));
        assert_eq!(attr(s, "transport").as_deref(), Some("loopback"), "{s:#?}");
    }
    let under = |parent: &SpanData, name: &str| {
        spans
            .iter()
            .filter(|s| s.name == name && s.parent_span_id == parent.span_context.span_id())
            .count()
    };
    assert_eq!(under(prefill, "kv_chunk"), 1, "one chunk of 40 tokens");
    assert_eq!(under(decode, "kv_receive"), 1, "one prefill rank");
    assert_eq!(under(decode, "kv_bootstrap"), 1);
    let batches: Vec<_> = spans.iter().filter(|s| s.name == "kv_batch").collect();
    assert!(!batches.is_empty());
    for b in batches {
        assert_eq!(b.span_context.trace_id(), decode.span_context.trace_id());
        assert!(attr(b, "bytes").unwrap().parse::<u64>().unwrap() > 0);
        assert!(attr(b, "ops").unwrap().parse::<u64>().unwrap() > 0);
    }
}

/// An engine's request spans given as W3C `traceparent`s (SGLang's and vLLM's come from
/// Python): each side's room span takes its engine's as parent, and the prefill's room span
/// links to the decode's instead of taking it as parent.
#[tokio::test(start_paused = true)]
async fn an_engines_traceparent_parents_each_sides_room_span() {
    let (exporter, _provider, _guard) = otel();
    let r = rig(Spec::mla_one_to_one()).await;
    let prefill_req = "00-0000000000000000aaaaaaaaaaaaaaaa-1111111111111111-01";
    let decode_req = "00-0000000000000000aaaaaaaaaaaaaaaa-2222222222222222-01";
    let req = Request {
        prefill_parent: TraceParent::parse(prefill_req),
        decode_parent: TraceParent::parse(decode_req),
        ..Request::new(8, 40)
    };
    for out in r.run(&req).await {
        out.unwrap();
    }
    bounded(r.prefills[0].0.wait(8)).await.unwrap();
    r.decodes[0].0.clear(8);
    r.prefills[0].0.clear(8);
    drop(r);
    let spans = exporter.get_finished_spans().unwrap();
    let decode = one(&spans, "kv_room", "decode");
    let prefill = one(&spans, "kv_room", "prefill");
    let trace = TraceId::from_hex("0000000000000000aaaaaaaaaaaaaaaa").unwrap();
    for (s, parent) in [(decode, "2222222222222222"), (prefill, "1111111111111111")] {
        assert_eq!(s.span_context.trace_id(), trace, "{s:#?}");
        assert_eq!(
            s.parent_span_id,
            SpanId::from_hex(parent).unwrap(),
            "{s:#?}"
        );
        assert!(s.parent_span_is_remote, "{s:#?}");
        assert_eq!(s.status, Status::Ok, "{s:#?}");
    }
    let links: Vec<SpanId> = prefill
        .links
        .iter()
        .map(|l| l.span_context.span_id())
        .collect();
    assert_eq!(
        links,
        vec![decode.span_context.span_id()],
        "the decode's room span is a link"
    );
    // The rest of each side hangs under its room span, in the engine's trace.
    for s in spans.iter().filter(|s| s.name != "kv_register") {
        assert_eq!(
            s.span_context.trace_id(),
            trace,
            "{} left the trace",
            s.name
        );
    }
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_room_ends_every_span_with_its_cause() {
    let (exporter, _provider, _guard) = otel();
    let mut spec = Spec::mla_one_to_one();
    spec.prefill_config = PrefillConfig::default().with_waiting_timeout(Duration::from_secs(600));
    let r = rig(spec).await;
    let req = Request::new(4, 40);
    r.start(&req).await;
    // The prefill never sends: the decode's waiting timeout fails the room and aborts it.
    let d = &r.decodes[0].0;
    bounded(d.wait(4)).await.unwrap_err();
    bounded(d.release_when_fenced(4)).await.unwrap();
    r.prefills[0].0.clear(4);
    drop(r);
    let spans = exporter.get_finished_spans().unwrap();
    let decode = one(&spans, "kv_room", "decode");
    let prefill = one(&spans, "kv_room", "prefill");
    assert_eq!(prefill.parent_span_id, decode.span_context.span_id());
    assert!(
        matches!(&decode.status, Status::Error { description } if description.contains("timed out")),
        "{decode:#?}"
    );
    assert_eq!(
        attr(decode, "error.type").as_deref(),
        Some("waiting_timeout")
    );
    assert_eq!(
        attr(prefill, "error.type").as_deref(),
        Some("remote_failure"),
        "{prefill:#?}"
    );
    // The prefill rank's receive never completed: it ends with the room's cause.
    let receive: Vec<_> = spans.iter().filter(|s| s.name == "kv_receive").collect();
    assert_eq!(receive.len(), 1, "{receive:#?}");
    assert_eq!(
        attr(receive[0], "error.type").as_deref(),
        Some("waiting_timeout")
    );
    // Every span's parent in this process ended too.
    for s in &spans {
        if s.parent_span_id != opentelemetry::trace::SpanId::INVALID && !s.parent_span_is_remote {
            assert!(
                spans
                    .iter()
                    .any(|p| p.span_context.span_id() == s.parent_span_id),
                "the parent of {} never ended",
                s.name
            );
        }
    }
}
