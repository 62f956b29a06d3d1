//! A Chrome trace file of `demo --trace` drawn as an SVG timeline (`kvbridge-lab trace-svg`):
//! one band per process and rank track, every slice a rectangle from its begin to its end on
//! one wall-clock axis, nested and overlapping slices stacked in lanes (a slice goes in the
//! first lane free at its start), coloured by span name, with the span's name and arguments in
//! each rectangle's `<title>` (shown on hover). Nothing is inferred: the rectangles are the
//! file's `b`/`e` pairs, the times its `ts`.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;

use serde_json::Value;

/// One slice: a begin and its end.
#[derive(Debug, Clone)]
struct Slice {
    pid: u64,
    tid: u64,
    name: String,
    start: u64,
    end: u64,
    args: serde_json::Map<String, Value>,
}

const LABEL_W: f64 = 120.0;
const PLOT_W: f64 = 1080.0;
const LANE_H: f64 = 14.0;
const GAP: f64 = 8.0;
const AXIS_H: f64 = 28.0;

/// The colour of a span name (kvbridge's names; others grey).
fn colour(name: &str) -> &'static str {
    match name {
        "kv_room" => "#4e79a7",
        "kv_register" => "#9c755f",
        "kv_bootstrap" => "#76b7b2",
        "kv_metadata" => "#edc948",
        "kv_chunk" => "#f28e2b",
        "kv_plan" => "#b07aa1",
        "kv_post" => "#ff9da7",
        "kv_batch" => "#59a14f",
        "kv_receive" => "#e15759",
        "kv_fence" => "#000000",
        _ => "#bab0ac",
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// The file's slices (begins matched to ends by process and `id2.local`), and its process
/// names; with `room`, only that room's slices (by their `room` argument, or for a slice
/// without one, lying within one of them on its track).
fn slices(doc: &Value, room: Option<u64>) -> Result<(Vec<Slice>, HashMap<u64, String>), String> {
    let events = doc["traceEvents"]
        .as_array()
        .ok_or("not a Chrome trace file: no traceEvents array")?;
    let mut names = HashMap::new();
    let mut open: HashMap<(u64, String), Slice> = HashMap::new();
    let mut done = Vec::new();
    for e in events {
        let pid = e["pid"].as_u64().unwrap_or(0);
        match e["ph"].as_str() {
            Some("M") if e["name"] == "process_name" => {
                let n = e["args"]["name"].as_str().unwrap_or_default();
                names.insert(pid, n.to_owned());
            }
            Some("b") => {
                let id = e["id2"]["local"].as_str().unwrap_or_default().to_owned();
                let s = Slice {
                    pid,
                    tid: e["tid"].as_u64().unwrap_or(0),
                    name: e["name"].as_str().unwrap_or_default().to_owned(),
                    start: e["ts"].as_u64().unwrap_or(0),
                    end: 0,
                    args: e["args"].as_object().cloned().unwrap_or_default(),
                };
                open.insert((pid, id), s);
            }
            Some("e") => {
                let id = e["id2"]["local"].as_str().unwrap_or_default().to_owned();
                if let Some(mut s) = open.remove(&(pid, id)) {
                    s.end = e["ts"].as_u64().unwrap_or(s.start).max(s.start);
                    if let Some(args) = e["args"].as_object() {
                        s.args.extend(args.clone());
                    }
                    done.push(s);
                }
            }
            _ => {}
        }
    }
    if let Some(room) = room {
        // A room's slices, and those without a `room` argument (`kv_post`, `kv_plan`) that lie
        // within one of them on the same track.
        let of_room = |s: &Slice| s.args.get("room").and_then(Value::as_u64) == Some(room);
        let kept: Vec<(u64, u64, u64, u64)> = done
            .iter()
            .filter(|s| of_room(s))
            .map(|s| (s.pid, s.tid, s.start, s.end))
            .collect();
        done.retain(|s| {
            of_room(s)
                || (!s.args.contains_key("room")
                    && kept.iter().any(|&(p, t, a, b)| {
                        (p, t) == (s.pid, s.tid) && a <= s.start && s.end <= b
                    }))
        });
    }
    if done.is_empty() {
        return Err(match room {
            Some(r) => format!("no slice of room {r} in the file; pick a room its spans name"),
            None => "no complete slice in the file".to_owned(),
        });
    }
    Ok((done, names))
}

/// Puts each slice of one track in the first lane free at its start; returns the lanes used.
fn lanes(track: &mut [(Slice, usize)]) -> usize {
    track.sort_by_key(|(s, _)| (s.start, std::cmp::Reverse(s.end)));
    let mut ends: Vec<u64> = Vec::new();
    for (s, lane) in track.iter_mut() {
        *lane = match ends.iter().position(|&e| e <= s.start) {
            Some(i) => i,
            None => {
                ends.push(0);
                ends.len() - 1
            }
        };
        ends[*lane] = s.end.max(s.start + 1);
    }
    ends.len()
}

/// The SVG text of `doc` (a Chrome trace file), optionally one room's slices only.
///
/// # Errors
/// A file that is not a Chrome trace, or holds no complete slice (of that room).
pub fn render(doc: &Value, room: Option<u64>) -> Result<String, String> {
    let (all, names) = slices(doc, room)?;
    let t0 = all.iter().map(|s| s.start).min().unwrap_or(0);
    let t1 = all.iter().map(|s| s.end).max().unwrap_or(t0).max(t0 + 1);
    let x = |t: u64| LABEL_W + (t - t0) as f64 * PLOT_W / (t1 - t0) as f64;
    let mut tracks: BTreeMap<(u64, u64), Vec<(Slice, usize)>> = BTreeMap::new();
    for s in all {
        tracks.entry((s.pid, s.tid)).or_default().push((s, 0));
    }
    let mut body = String::new();
    let mut y = AXIS_H;
    for ((pid, tid), track) in &mut tracks {
        let n = lanes(track);
        let h = n as f64 * LANE_H;
        let process = names
            .get(pid)
            .cloned()
            .unwrap_or_else(|| format!("pid {pid}"));
        let label = if process == "prefill" {
            format!("prefill rank {tid}")
        } else {
            process
        };
        let _ = writeln!(
            body,
            r#"<rect x="0" y="{y:.1}" width="{w:.1}" height="{h:.1}" fill="{bg}"/><text x="4" y="{ty:.1}" font-size="11">{}</text>"#,
            escape(&label),
            w = LABEL_W + PLOT_W,
            bg = if pid % 2 == 0 { "#f4f4f4" } else { "#ffffff" },
            ty = y + 11.0,
        );
        for (s, lane) in track.iter() {
            slice(
                &mut body,
                s,
                y + *lane as f64 * LANE_H + 1.0,
                x(s.start),
                x(s.end),
            );
        }
        y += h + GAP;
    }
    let mut axis = String::new();
    let span_ms = (t1 - t0) as f64 / 1000.0;
    let step = nice_step(span_ms / 8.0);
    let mut t = 0.0;
    while t <= span_ms + 1e-9 {
        let tx = LABEL_W + t / span_ms * PLOT_W;
        let _ = write!(
            axis,
            r##"<line x1="{tx:.1}" y1="{a:.1}" x2="{tx:.1}" y2="{y:.1}" stroke="#ccc"/><text x="{tx:.1}" y="14" font-size="10" text-anchor="middle">{t} ms</text>"##,
            a = AXIS_H - 6.0,
        );
        t += step;
    }
    let legend_y = y + 14.0;
    let legend = legend(legend_y);
    let height = legend_y + 8.0;
    Ok(format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{height:.0}" font-family="sans-serif">
<rect width="100%" height="100%" fill="#fff"/>
{axis}
{body}{legend}
</svg>
"##,
        w = LABEL_W + PLOT_W + 10.0,
    ))
}

/// One slice's rectangle at `ly`, from `x0` to `x1`, its name inside when it fits.
fn slice(body: &mut String, s: &Slice, ly: f64, x0: f64, x1: f64) {
    let w = (x1 - x0).max(0.5);
    let args: Vec<String> = s.args.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let title = format!(
        "{} {:.3} ms\n{}",
        s.name,
        (s.end - s.start) as f64 / 1000.0,
        args.join("\n")
    );
    let _ = write!(
        body,
        r#"<g><title>{}</title><rect x="{x0:.2}" y="{ly:.1}" width="{w:.2}" height="{lh:.1}" fill="{}"/>"#,
        escape(&title),
        colour(&s.name),
        lh = LANE_H - 2.0,
    );
    if w > 7.0 * s.name.len() as f64 {
        let _ = write!(
            body,
            r##"<text x="{tx:.2}" y="{ty:.1}" font-size="9" fill="#fff">{}</text>"##,
            escape(&s.name),
            tx = x0 + 2.0,
            ty = ly + 9.5,
        );
    }
    body.push_str("</g>\n");
}

/// The colour key below the tracks, at `y`.
fn legend(y: f64) -> String {
    let mut legend = String::new();
    let mut lx = LABEL_W;
    for name in [
        "kv_room",
        "kv_bootstrap",
        "kv_receive",
        "kv_metadata",
        "kv_chunk",
        "kv_plan",
        "kv_post",
        "kv_batch",
        "kv_register",
    ] {
        let _ = write!(
            legend,
            r#"<rect x="{lx:.1}" y="{ry:.1}" width="10" height="10" fill="{}"/><text x="{tx:.1}" y="{y:.1}" font-size="10">{name}</text>"#,
            colour(name),
            ry = y - 9.0,
            tx = lx + 13.0,
        );
        lx += 100.0;
    }
    legend
}

/// A round step (1, 2 or 5 times a power of ten) of at least `raw` milliseconds.
fn nice_step(raw: f64) -> f64 {
    let raw = raw.max(1e-3);
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ev(ph: &str, pid: u64, tid: u64, id: &str, name: &str, ts: u64, room: u64) -> Value {
        json!({"ph": ph, "pid": pid, "tid": tid, "id2": {"local": id}, "name": name,
               "ts": ts, "args": {"room": room}})
    }

    fn doc() -> Value {
        json!({"traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "prefill"}},
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "decode 0"}},
            ev("b", 0, 0, "1", "kv_room", 1000, 7),
            ev("b", 0, 0, "2", "kv_chunk", 1500, 7),
            ev("b", 0, 0, "3", "kv_chunk", 1600, 7),
            ev("e", 0, 0, "2", "kv_chunk", 2500, 7),
            ev("e", 0, 0, "3", "kv_chunk", 2600, 7),
            ev("e", 0, 0, "1", "kv_room", 3000, 7),
            ev("b", 1, 0, "1", "kv_room", 900, 7),
            ev("e", 1, 0, "1", "kv_room", 3100, 7),
            ev("b", 1, 0, "9", "kv_room", 4000, 8),
            ev("e", 1, 0, "9", "kv_room", 5000, 8),
            ev("b", 1, 0, "5", "kv_receive", 950, 7),
            json!({"ph": "b", "pid": 0, "tid": 0, "id2": {"local": "6"}, "name": "kv_post", "ts": 1700}),
            json!({"ph": "e", "pid": 0, "tid": 0, "id2": {"local": "6"}, "name": "kv_post", "ts": 1800}),
            json!({"ph": "b", "pid": 0, "tid": 0, "id2": {"local": "7"}, "name": "kv_register", "ts": 10}),
            json!({"ph": "e", "pid": 0, "tid": 0, "id2": {"local": "7"}, "name": "kv_register", "ts": 20}),
        ]})
    }

    #[test]
    fn overlapping_slices_take_lanes_and_only_the_rooms_slices_are_drawn() {
        let (s, names) = slices(&doc(), Some(7)).unwrap();
        // The unfinished kv_receive, room 8 and the registration before the room are left
        // out; the post within the room's chunk is in.
        assert_eq!(s.len(), 5, "{s:?}");
        assert_eq!(names[&1], "decode 0");
        let mut prefill: Vec<_> = s
            .into_iter()
            .filter(|s| s.pid == 0)
            .map(|s| (s, 0))
            .collect();
        // The room, then two chunks that overlap each other, then the post in a fourth lane.
        assert_eq!(lanes(&mut prefill), 4);
        let by: Vec<(String, usize)> = prefill.iter().map(|(s, l)| (s.name.clone(), *l)).collect();
        assert_eq!(
            by,
            [
                ("kv_room".into(), 0),
                ("kv_chunk".into(), 1),
                ("kv_chunk".into(), 2),
                ("kv_post".into(), 3)
            ]
        );
        let svg = render(&doc(), Some(7)).unwrap();
        assert_eq!(svg.matches("<title>").count(), 5);
        assert!(
            svg.contains("prefill rank 0") && svg.contains("decode 0"),
            "{svg}"
        );
        assert!(render(&doc(), Some(9)).unwrap_err().contains("room 9"));
    }

    #[test]
    fn steps_are_round() {
        assert_eq!(nice_step(0.7), 1.0);
        assert_eq!(nice_step(1.3), 2.0);
        assert_eq!(nice_step(31.0), 50.0);
    }
}
