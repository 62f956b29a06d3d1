//! Spans as Chrome trace-event JSON (the format Perfetto and `chrome://tracing` open).
//!
//! Each span is one async slice (`"ph":"b"` at its creation, `"ph":"e"` at its close, the
//! same process-local `id2`), so overlapping rooms, chunks and batches stay apart; `pid` is the process (its
//! index in the run), `tid` the rank (the `rank` / `dcp_rank` field of the span or of its
//! closest ancestor that has one), and the span's fields are its `args`. Timestamps are wall
//! clock microseconds, so the files of several processes merge onto one time line
//! ([`merge`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value, json};
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Subscriber, span};
use tracing_subscriber::layer::Context;
use tracing_subscriber::registry::LookupSpan;

/// Where one process writes its spans and how a trace viewer names it.
#[derive(Debug, Clone)]
pub struct ChromeOptions {
    /// The file to write (a JSON object with `traceEvents`).
    pub path: PathBuf,
    /// This process's id in the merged trace.
    pub pid: u32,
    /// This process's name in the viewer (e.g. `prefill`, `decode 1`).
    pub process: String,
}

/// Collects the events of one process and writes them on [`write`](Self::write).
#[derive(Debug)]
pub struct ChromeWriter {
    options: ChromeOptions,
    events: Arc<Mutex<Vec<Value>>>,
}

/// The `tracing` layer that records each span's open and close into a [`ChromeWriter`].
#[derive(Debug)]
pub struct ChromeLayer {
    pid: u32,
    events: Arc<Mutex<Vec<Value>>>,
}

/// What a span keeps until it closes.
struct Open {
    tid: u64,
    args: Map<String, Value>,
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ChromeWriter {
    /// A writer for `options`; nothing is written before [`write`](Self::write).
    pub fn new(options: ChromeOptions) -> Self {
        Self {
            options,
            events: Arc::default(),
        }
    }

    /// The layer that feeds this writer.
    pub fn layer(&self) -> ChromeLayer {
        ChromeLayer {
            pid: self.options.pid,
            events: self.events.clone(),
        }
    }

    /// The file this writer writes.
    pub fn path(&self) -> &Path {
        &self.options.path
    }

    /// Writes every event recorded so far, after the process's name.
    ///
    /// # Errors
    /// The file could not be written (the message names it and the I/O error).
    pub fn write(&self) -> Result<(), String> {
        let mut events = vec![json!({
            "name": "process_name", "ph": "M", "pid": self.options.pid,
            "args": {"name": self.options.process},
        })];
        events.append(&mut lock(&self.events));
        let doc = json!({"traceEvents": events, "displayTimeUnit": "ms"});
        std::fs::write(&self.options.path, doc.to_string()).map_err(|e| {
            format!(
                "could not write the trace file {}: {e}",
                self.options.path.display()
            )
        })
    }
}

/// Merges the trace files `parts` (each as [`ChromeWriter::write`] wrote it) into `out`,
/// removing each part once read; a part that is missing (its process died before writing)
/// is skipped and named in the result.
///
/// # Errors
/// `out` could not be written.
pub fn merge(parts: &[PathBuf], out: &Path) -> Result<Vec<String>, String> {
    let mut events = Vec::new();
    let mut missing = Vec::new();
    for p in parts {
        let doc = std::fs::read(p)
            .ok()
            .and_then(|b| serde_json::from_slice::<Value>(&b).ok());
        match doc {
            Some(mut d) => {
                if let Some(Value::Array(e)) = d.get_mut("traceEvents").map(Value::take) {
                    events.extend(e);
                }
                let _ = std::fs::remove_file(p);
            }
            None => missing.push(p.display().to_string()),
        }
    }
    let doc = json!({"traceEvents": events, "displayTimeUnit": "ms"});
    std::fs::write(out, doc.to_string())
        .map_err(|e| format!("could not write the trace file {}: {e}", out.display()))?;
    Ok(missing)
}

/// A span's fields as JSON values.
struct Fields<'a>(&'a mut Map<String, Value>);

impl Visit for Fields<'_> {
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().to_owned(), json!(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().to_owned(), json!(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().to_owned(), json!(value));
    }
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), json!(value));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().to_owned(), json!(format!("{value:?}")));
    }
}

impl<S> tracing_subscriber::Layer<S> for ChromeLayer
where
    S: Subscriber + for<'a> LookupSpan<'a>,
{
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(id) else { return };
        let mut args = Map::new();
        attrs.record(&mut Fields(&mut args));
        let own = ["rank", "dcp_rank"]
            .iter()
            .find_map(|k| args.get(*k).and_then(Value::as_u64));
        let tid = own
            .or_else(|| {
                span.parent()
                    .and_then(|p| p.extensions().get::<Open>().map(|o| o.tid))
            })
            .unwrap_or(0);
        lock(&self.events).push(json!({
            "name": attrs.metadata().name(), "cat": "kvbridge", "ph": "b",
            "id2": {"local": format!("{:#x}", id.into_u64())}, "pid": self.pid, "tid": tid,
            "ts": now_us(),
        }));
        span.extensions_mut().insert(Open { tid, args });
    }

    fn on_record(&self, id: &span::Id, values: &Record<'_>, ctx: Context<'_, S>) {
        if let Some(span) = ctx.span(id) {
            if let Some(open) = span.extensions_mut().get_mut::<Open>() {
                values.record(&mut Fields(&mut open.args));
            }
        }
    }

    fn on_close(&self, id: Id, ctx: Context<'_, S>) {
        let Some(span) = ctx.span(&id) else { return };
        let Some(open) = span.extensions_mut().remove::<Open>() else {
            return;
        };
        lock(&self.events).push(json!({
            "name": span.name(), "cat": "kvbridge", "ph": "e",
            "id2": {"local": format!("{:#x}", id.into_u64())}, "pid": self.pid, "tid": open.tid,
            "ts": now_us(), "args": open.args,
        }));
    }
}
