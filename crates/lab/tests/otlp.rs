//! Spans against a real OTLP receiver: the test starts an OTLP/HTTP endpoint (`POST
//! /v1/traces`, the official `opentelemetry-proto` `ExportTraceServiceRequest` decoded with
//! prost) or an OTLP/gRPC one (opentelemetry-proto's tonic `TraceService` served by tonic) and
//! runs `kvbridge-lab demo` across real processes with `OTEL_EXPORTER_OTLP_ENDPOINT` (and for
//! gRPC `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=grpc`) pointing at it. A transfer's spans must form one trace per
//! room across the prefill and decode processes; a failed one's must carry the cause; every
//! span must end (an exported child whose parent never arrived means the parent never ended).

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{KeyValue, any_value};
use opentelemetry_proto::tonic::trace::v1::status::StatusCode;
use prost::Message;
use serde_json::Value;

/// One exported span, as the test reads it.
#[derive(Debug, Clone)]
struct Got {
    process: String,
    name: String,
    trace: Vec<u8>,
    id: Vec<u8>,
    parent: Vec<u8>,
    links: Vec<Vec<u8>>,
    attrs: HashMap<String, String>,
    status: i32,
    message: String,
    start: u64,
    end: u64,
}

fn text(kv: &KeyValue) -> String {
    match kv.value.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// An OTLP endpoint. HTTP: every request body on every connection (keep-alive included)
/// decoded and kept; answered 200 with an empty protobuf body. gRPC: every `Export` call's
/// spans kept.
struct Receiver {
    port: u16,
    spans: Arc<Mutex<Vec<Got>>>,
    /// What the demo is told to export with (`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`); `None`:
    /// no protocol variable (the default, http/protobuf).
    protocol: Option<&'static str>,
}

/// The gRPC receiver's service: keeps every exported span.
struct GrpcSink(Arc<Mutex<Vec<Got>>>);

#[tonic::async_trait]
impl TraceService for GrpcSink {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.lock().unwrap().extend(flatten(request.into_inner()));
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

impl Receiver {
    /// An OTLP/gRPC receiver on a runtime of its own thread (serving until the test exits).
    fn start_grpc() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the OTLP/gRPC receiver");
        listener.set_nonblocking(true).unwrap();
        let port = listener.local_addr().unwrap().port();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let sink = GrpcSink(spans.clone());
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("the receiver's runtime");
            rt.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                tonic::transport::Server::builder()
                    .add_service(TraceServiceServer::new(sink))
                    .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
                    .await
                    .expect("the OTLP/gRPC receiver");
            });
        });
        Self {
            port,
            spans,
            protocol: Some("grpc"),
        }
    }

    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the OTLP receiver");
        let port = listener.local_addr().unwrap().port();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let kept = spans.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let kept = kept.clone();
                std::thread::spawn(move || serve(conn, &kept));
            }
        });
        Self {
            port,
            spans,
            protocol: None,
        }
    }

    fn spans(&self) -> Vec<Got> {
        self.spans.lock().unwrap().clone()
    }
}

fn serve(conn: TcpStream, kept: &Mutex<Vec<Got>>) {
    conn.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let mut out = conn.try_clone().expect("clone the connection");
    let mut r = BufReader::new(conn);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        assert!(
            line.starts_with("POST /v1/traces "),
            "request line {line:?}"
        );
        let mut len = 0usize;
        let mut content_type = String::new();
        loop {
            let mut h = String::new();
            r.read_line(&mut h).expect("a header line");
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            let (k, v) = h.split_once(':').expect("a header");
            match k.to_ascii_lowercase().as_str() {
                "content-length" => len = v.trim().parse().expect("a length"),
                "content-type" => content_type = v.trim().to_owned(),
                _ => {}
            }
        }
        assert_eq!(content_type, "application/x-protobuf", "OTLP/HTTP protobuf");
        let mut body = vec![0; len];
        r.read_exact(&mut body).expect("the body");
        let req = ExportTraceServiceRequest::decode(&body[..]).expect("an OTLP export request");
        kept.lock().unwrap().extend(flatten(req));
        let ok =
            "HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\n\r\n";
        if out.write_all(ok.as_bytes()).is_err() {
            return;
        }
    }
}

fn flatten(req: ExportTraceServiceRequest) -> Vec<Got> {
    let mut v = Vec::new();
    for rs in req.resource_spans {
        let process = rs
            .resource
            .iter()
            .flat_map(|r| &r.attributes)
            .find(|kv| kv.key == "kvbridge.process")
            .map(text)
            .unwrap_or_default();
        for ss in rs.scope_spans {
            for s in ss.spans {
                let status = s.status.clone().unwrap_or_default();
                v.push(Got {
                    process: process.clone(),
                    name: s.name,
                    trace: s.trace_id,
                    id: s.span_id,
                    parent: s.parent_span_id,
                    links: s.links.into_iter().map(|l| l.span_id).collect(),
                    attrs: s
                        .attributes
                        .iter()
                        .map(|kv| (kv.key.clone(), text(kv)))
                        .collect(),
                    status: status.code,
                    message: status.message,
                    start: s.start_time_unix_nano,
                    end: s.end_time_unix_nano,
                });
            }
        }
    }
    v
}

/// Runs `kvbridge-lab demo --json ARGS` exporting to `rx`; returns (exit code, report).
/// Fails the test if the demo does not finish within a minute.
fn demo(rx: &Receiver, args: &[&str]) -> (i32, Value) {
    let tmp = std::env::temp_dir().join(format!("kvb-otlp-{}-{}", std::process::id(), rx.port));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kvbridge-lab"));
    match rx.protocol {
        // The signal's own variable wins over the general one.
        Some(p) => cmd
            .env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", p)
            .env("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"),
        None => cmd
            .env_remove("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .env_remove("OTEL_EXPORTER_OTLP_PROTOCOL"),
    };
    let mut child = cmd
        .arg("demo")
        .arg("--json")
        .args(args)
        .env("TMPDIR", &tmp)
        .env_remove("XDG_RUNTIME_DIR")
        .env("RUST_LOG", "error")
        .env(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            format!("http://127.0.0.1:{}", rx.port),
        )
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env("NO_PROXY", "127.0.0.1")
        .env_remove("HTTP_PROXY")
        .env_remove("http_proxy")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start kvbridge-lab demo");
    let start = Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if start.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("kvbridge-lab demo {args:?} did not finish within 60 s");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = child.wait_with_output().expect("output");
    let _ = std::fs::remove_dir_all(&tmp);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report =
        serde_json::from_str(stdout.lines().last().unwrap_or_default()).unwrap_or_else(|e| {
            panic!(
                "no JSON report ({e}); stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    (out.status.code().unwrap_or(-1), report)
}

/// The spans of `name` for `room`, in every process.
fn find<'a>(spans: &'a [Got], name: &str, room: &str) -> Vec<&'a Got> {
    spans
        .iter()
        .filter(|s| s.name == name && s.attrs.get("room").map(String::as_str) == Some(room))
        .collect()
}

/// Every span ended (OTLP carries only ended spans; an end before its start is a bug), and
/// every exported span's parent in its own process was exported too (a parent that never
/// ended would be missing). A room span's parent is the decode's, in another process.
/// Spans of the processes in `killed` are skipped: a killed process ends nothing.
fn assert_every_span_ended(spans: &[Got], killed: &[&str]) {
    let ids: HashSet<(&str, &[u8])> = spans
        .iter()
        .map(|s| (s.process.as_str(), s.id.as_slice()))
        .collect();
    for s in spans
        .iter()
        .filter(|s| !killed.contains(&s.process.as_str()))
    {
        assert!(s.end >= s.start && s.start > 0, "{s:?}");
        if s.parent.is_empty() || s.name == "kv_room" {
            continue;
        }
        assert!(
            ids.contains(&(s.process.as_str(), s.parent.as_slice())),
            "the parent of {} in {} never ended: {s:?}",
            s.name,
            s.process
        );
    }
}

/// Waits until the receiver holds spans from `processes` processes (the exports of processes
/// that already exited are in; bounded).
fn spans_from(rx: &Receiver, processes: usize) -> Vec<Got> {
    let start = Instant::now();
    loop {
        let spans = rx.spans();
        let seen: HashSet<&str> = spans.iter().map(|s| s.process.as_str()).collect();
        if seen.len() >= processes || start.elapsed() > Duration::from_secs(10) {
            return spans;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

const OK_RUN: &[&str] = &[
    "--transport",
    "shm",
    "--dcp",
    "4",
    "--layers",
    "3",
    "--page-size",
    "16",
    "--tokens",
    "256",
    "--chunk-tokens",
    "64",
    "--requests",
    "2",
    "--concurrency",
    "2",
    "--timeout",
    "10",
];

#[test]
fn a_transfer_is_one_trace_per_room_across_the_prefill_and_decode_processes() {
    let rx = Receiver::start();
    let (code, report) = demo(&rx, OK_RUN);
    assert_eq!(code, 0, "{report:#}");
    assert_one_trace_per_room(&spans_from(&rx, 5));
}

#[test]
fn over_grpc_a_transfer_is_one_trace_per_room_too() {
    let rx = Receiver::start_grpc();
    let (code, report) = demo(&rx, OK_RUN);
    assert_eq!(code, 0, "{report:#}");
    let spans = spans_from(&rx, 5);
    let processes: HashSet<&str> = spans.iter().map(|s| s.process.as_str()).collect();
    assert_eq!(
        processes.len(),
        5,
        "every process exported over gRPC: {processes:?}"
    );
    assert_one_trace_per_room(&spans);
}

/// OK_RUN's two rooms: each one trace from the decode ranks' room spans to the prefill's
/// chunks and batches, every span ended well.
fn assert_one_trace_per_room(spans: &[Got]) {
    assert_every_span_ended(spans, &[]);
    // The rooms the demo used, as the spans name them.
    let rooms = find_all_rooms(spans);
    assert_eq!(rooms.len(), 2, "two requests, two rooms: {rooms:?}");
    for room in &rooms {
        let rooms = find(spans, "kv_room", room);
        let prefill: Vec<_> = rooms.iter().filter(|s| s.process == "prefill").collect();
        let decodes: Vec<_> = rooms.iter().filter(|s| s.process != "prefill").collect();
        assert_eq!(prefill.len(), 1, "one prefill room span for room {room}");
        assert_eq!(
            decodes.len(),
            4,
            "one room span per decode rank for room {room}"
        );
        let p = prefill[0];
        // The prefill's room span is a child of one decode rank's room span (same trace) and
        // links to the other three.
        let parent = decodes
            .iter()
            .find(|d| d.id == p.parent)
            .unwrap_or_else(|| panic!("the prefill room span's parent is no decode room: {p:?}"));
        assert_eq!(p.trace, parent.trace, "one trace across the PD boundary");
        let mut reached: HashSet<&[u8]> = p.links.iter().map(Vec::as_slice).collect();
        reached.insert(p.parent.as_slice());
        for d in &decodes {
            assert!(
                reached.contains(d.id.as_slice()),
                "decode room not linked: {d:?}"
            );
            assert_eq!(d.status, StatusCode::Ok as i32, "{d:?}");
            assert_eq!(d.attrs["transport"], "shm");
            assert_eq!(d.attrs["side"], "decode");
        }
        assert_eq!(p.status, StatusCode::Ok as i32, "{p:?}");
        assert_eq!(p.attrs["transport"], "shm");
        assert!(p.attrs["bytes"].parse::<u64>().unwrap() > 0, "{p:?}");
        // Chunks hang under the prefill's room span; batches per chunk and decode rank carry
        // their bytes and descriptors.
        let chunks = find(spans, "kv_chunk", room);
        assert_eq!(chunks.len(), 4, "256 tokens in chunks of 64");
        for c in &chunks {
            assert_eq!(
                (c.trace.as_slice(), c.parent.as_slice()),
                (&p.trace[..], &p.id[..])
            );
        }
        let batches = find(spans, "kv_batch", room);
        assert!(
            batches.len() >= 16,
            "a batch per chunk and decode rank: {}",
            batches.len()
        );
        for b in &batches {
            assert_eq!(b.trace, p.trace);
            assert_eq!(b.status, StatusCode::Ok as i32, "{b:?}");
            assert!(b.attrs["bytes"].parse::<u64>().unwrap() > 0, "{b:?}");
            assert!(b.attrs["ops"].parse::<u64>().unwrap() > 0, "{b:?}");
            assert_eq!(b.attrs["transport"], "shm");
        }
        // Each decode rank's receive from the prefill ends when its data landed.
        let receives = find(spans, "kv_receive", room);
        assert_eq!(receives.len(), 4, "{receives:?}");
        for r in &receives {
            let d = decodes
                .iter()
                .find(|d| d.id == r.parent)
                .expect("under its room");
            assert_eq!(r.trace, d.trace);
            assert_eq!(r.status, StatusCode::Ok as i32, "{r:?}");
        }
    }
}

fn find_all_rooms(spans: &[Got]) -> HashSet<String> {
    spans
        .iter()
        .filter(|s| s.name == "kv_room")
        .filter_map(|s| s.attrs.get("room").cloned())
        .collect()
}

/// The failure causes a kill of a decode rank can leave, as the metrics name them.
const CAUSES: &[&str] = &[
    "peer_lost",
    "transfer_error",
    "batch_timeout",
    "waiting_timeout",
    "aborted",
    "remote_failure",
    "control_channel",
    "other_rank",
];

#[test]
fn a_failed_transfer_ends_every_span_with_the_cause_in_its_status() {
    let rx = Receiver::start();
    let mut args = vec!["--transport", "shm", "--kill", "decode:1@1"];
    args.extend_from_slice(&[
        "--dcp",
        "2",
        "--tokens",
        "512",
        "--layers",
        "2",
        "--page-size",
        "16",
        "--chunk-tokens",
        "64",
        "--chunk-delay-ms",
        "150",
        "--requests",
        "3",
        "--concurrency",
        "1",
        "--timeout",
        "2",
    ]);
    let (code, report) = demo(&rx, &args);
    assert_eq!(code, 1, "{report:#}");
    // The prefill and decode 0 survive and export; decode 1 was killed.
    let spans = spans_from(&rx, 2);
    assert_every_span_ended(&spans, &["decode 1"]);
    let failed: Vec<&Got> = spans
        .iter()
        .filter(|s| s.name == "kv_room" && s.status == StatusCode::Error as i32)
        .collect();
    let prefill = failed
        .iter()
        .find(|s| s.process == "prefill")
        .unwrap_or_else(|| panic!("no failed prefill room span among {failed:#?}"));
    let decode = failed
        .iter()
        .find(|s| s.process == "decode 0" && s.attrs["room"] == prefill.attrs["room"])
        .unwrap_or_else(|| panic!("decode 0 did not fail the prefill's failed room: {failed:#?}"));
    for s in [prefill, decode] {
        let cause = s.attrs.get("error.type").map(String::as_str);
        assert!(CAUSES.contains(&cause.unwrap_or("none")), "{s:?}");
        assert!(
            !s.message.is_empty(),
            "the reason is the status description: {s:?}"
        );
    }
    // The failed room's prefill span still joins the decode's trace: decode 0's room span is
    // its parent (same trace) or a link (when decode 1's metadata came first).
    assert!(
        (prefill.parent == decode.id && prefill.trace == decode.trace)
            || prefill.links.contains(&decode.id),
        "{prefill:?}\n{decode:?}"
    );
    // Under the failed room, every span of the prefill ended, a fence ran, and a failed
    // batch or post carries its cause.
    let room = &prefill.attrs["room"];
    assert!(
        !find(&spans, "kv_fence", room).is_empty(),
        "the failed room was fenced"
    );
    let under: Vec<_> = spans
        .iter()
        .filter(|s| s.trace == prefill.trace && s.status == StatusCode::Error as i32)
        .filter(|s| ["kv_batch", "kv_post", "kv_chunk", "kv_receive"].contains(&s.name.as_str()))
        .collect();
    for s in &under {
        let cause = s.attrs.get("error.type").map(String::as_str);
        assert!(CAUSES.contains(&cause.unwrap_or("none")), "{s:?}");
    }
}

#[test]
fn demo_trace_writes_one_chrome_trace_with_a_process_per_demo_process() {
    let dir = std::env::temp_dir().join(format!("kvb-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("run.json");
    let rx = Receiver::start();
    let mut args = OK_RUN.to_vec();
    let path = file.to_str().unwrap().to_owned();
    args.extend_from_slice(&["--trace", &path]);
    let (code, report) = demo(&rx, &args);
    assert_eq!(code, 0, "{report:#}");
    let doc: Value = serde_json::from_slice(&std::fs::read(&file).expect("the trace file"))
        .expect("the trace file is JSON");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(left.len(), 1, "the parts are merged and removed: {left:?}");
    let events = doc["traceEvents"].as_array().expect("traceEvents");
    // A named process per demo process: the prefill (pid 0) and decode ranks 0..4.
    let mut names: Vec<(u64, String)> = events
        .iter()
        .filter(|e| e["ph"] == "M" && e["name"] == "process_name")
        .map(|e| {
            (
                e["pid"].as_u64().unwrap(),
                e["args"]["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    names.sort();
    let want: Vec<(u64, String)> = [
        (0, "prefill"),
        (1, "decode 0"),
        (2, "decode 1"),
        (3, "decode 2"),
        (4, "decode 3"),
    ]
    .iter()
    .map(|(p, n)| (*p, (*n).to_owned()))
    .collect();
    assert_eq!(names, want);
    // Every slice that begins ends, in the same process, not before it began; the decode
    // ranks' slices are on their rank's track.
    let mut open: HashMap<(u64, String), (u64, u64)> = HashMap::new();
    for e in events.iter().filter(|e| e["ph"] == "b") {
        let key = (
            e["pid"].as_u64().unwrap(),
            e["id2"]["local"].as_str().unwrap().to_owned(),
        );
        open.insert(key, (e["ts"].as_u64().unwrap(), e["tid"].as_u64().unwrap()));
    }
    let mut names_seen = HashSet::new();
    for e in events.iter().filter(|e| e["ph"] == "e") {
        let pid = e["pid"].as_u64().unwrap();
        let key = (pid, e["id2"]["local"].as_str().unwrap().to_owned());
        let (ts, tid) = open.remove(&key).expect("an end has its begin");
        assert!(e["ts"].as_u64().unwrap() >= ts, "{e}");
        if pid > 0 {
            assert_eq!(tid, pid - 1, "decode rank {}'s track: {e}", pid - 1);
        }
        names_seen.insert(e["name"].as_str().unwrap().to_owned());
    }
    assert!(open.is_empty(), "slices that never ended: {open:?}");
    for n in [
        "kv_room",
        "kv_chunk",
        "kv_plan",
        "kv_post",
        "kv_batch",
        "kv_receive",
        "kv_register",
    ] {
        assert!(names_seen.contains(n), "{n} missing from {names_seen:?}");
    }
}
