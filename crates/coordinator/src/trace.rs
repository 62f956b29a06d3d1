//! The agents' spans as OpenTelemetry sees them (docs/tracing.md): a span's W3C trace context
//! read for the decode's `transfer_info`, set as the prefill room's parent, and a failure's
//! cause set as a span's status.
//!
//! Everything goes through `tracing-opentelemetry`'s span extension, so it costs one lookup
//! and does nothing when no OpenTelemetry layer is installed (the library installs none):
//! no context is read, none is sent, no status is set.

use opentelemetry::trace::{
    SpanContext, SpanId, Status, TraceContextExt, TraceFlags, TraceId, TraceState,
};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

use crate::state::{FailureCause, FailureReason};
use kvbridge_control::TraceParent;

/// `span`'s trace context as a `traceparent`; `None` when the span is disabled or no
/// OpenTelemetry layer gives it a valid context.
pub(crate) fn traceparent(span: &Span) -> Option<TraceParent> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| TraceParent {
        trace_id: sc.trace_id().to_bytes(),
        span_id: sc.span_id().to_bytes(),
        flags: sc.trace_flags().to_u8(),
    })
}

/// Joins `span` to a peer's trace: the peer's span becomes its parent when `first` (the first
/// context heard for the room) and the span has not started yet; otherwise a link, so every
/// decode rank of a DCP fan-out is reachable from the prefill's room span.
pub(crate) fn adopt(span: &Span, tp: &TraceParent, first: bool) {
    if span.is_disabled() {
        return;
    }
    let sc = SpanContext::new(
        TraceId::from_bytes(tp.trace_id),
        SpanId::from_bytes(tp.span_id),
        TraceFlags::new(tp.flags),
        true,
        TraceState::default(),
    );
    let parented = first
        && span
            .set_parent(opentelemetry::Context::new().with_remote_span_context(sc.clone()))
            .is_ok();
    if !parented {
        span.add_link(sc);
    }
}

/// Marks `span` failed with kvbridge's cause: status `ERROR` with the reason as its
/// description and the cause (the metrics' `cause` label) as `error.type`, OpenTelemetry's
/// semantic convention for a failure's class.
pub(crate) fn fail(span: &Span, cause: FailureCause, message: &str) {
    if span.is_disabled() {
        return;
    }
    span.record("otel.status_code", "ERROR");
    span.record("error.type", cause.as_str());
    span.set_status(Status::error(message.to_owned()));
}

/// [`fail`] with a room's failure reason.
pub(crate) fn fail_with(span: &Span, reason: &FailureReason) {
    fail(span, reason.cause, &reason.message);
}

/// Marks `span` as ended well (status `OK`).
pub(crate) fn ok(span: &Span) {
    if span.is_disabled() {
        return;
    }
    span.record("otel.status_code", "OK");
    span.set_status(Status::Ok);
}

/// Parents `span`, not yet entered, to an engine's request span: for spans an embedder opens
/// around its own transport calls (the Python engine's `kv_write`), as the agents do for rooms.
pub fn set_span_parent(span: &Span, parent: &TraceParent) {
    adopt(span, parent, true);
}

/// Sets `span`'s status from how a transport batch ended: `OK`, or `ERROR` with the cause as
/// `error.type` (`batch_timeout` past its deadline, `aborted` when cancelled by its caller,
/// `transfer_error` otherwise) and the transport's message. The span should declare the
/// fields `otel.status_code` and `error.type`.
pub fn set_batch_span_status(span: &Span, ended: Result<(), &kvbridge_transport::TransportError>) {
    use kvbridge_transport::TransportError;
    match ended {
        Ok(()) => ok(span),
        Err(e) => {
            let cause = match e {
                TransportError::TimedOut { .. } => FailureCause::BatchTimeout,
                TransportError::Cancelled { .. } => FailureCause::Aborted,
                _ => FailureCause::TransferError,
            };
            fail(span, cause, &e.to_string());
        }
    }
}
