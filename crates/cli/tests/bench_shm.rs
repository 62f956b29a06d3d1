//! A quick smoke run of `kvbridge bench --transport shm`: tiny sizes, one run, JSON output.

use std::process::Command;

const KEYS: [&str; 9] = [
    "transport",
    "pattern",
    "bytes",
    "blocks",
    "gbps",
    "baseline",
    "baseline_gbps",
    "ratio",
    "receiver_peak_rss_bytes",
];

#[test]
fn shm_bench_prints_one_json_object_per_pattern() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args([
            "bench",
            "--transport",
            "shm",
            "--json",
            "--runs",
            "1",
            "--size-scale",
            "0.001",
        ])
        .output()
        .expect("run kvbridge bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "status {}; stderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?} is not JSON: {e}")))
        .collect();
    let patterns: Vec<&str> = lines
        .iter()
        .map(|v| v["pattern"].as_str().unwrap())
        .collect();
    assert_eq!(
        patterns,
        [
            "large",
            "scatter-64k",
            "scatter-72k",
            "scatter-16k",
            "latency-4k"
        ]
    );
    for v in &lines {
        for key in KEYS {
            assert!(v.get(key).is_some(), "{key} missing in {v}");
        }
        assert_eq!(v["transport"], "shm");
        assert_eq!(v["verified"], true, "{v}");
        let gbps = v["gbps"].as_f64().unwrap();
        let base = v["baseline_gbps"].as_f64().unwrap();
        let ratio = v["ratio"].as_f64().unwrap();
        assert!(gbps > 0.0 && base > 0.0, "{v}");
        assert!((ratio - gbps / base).abs() <= 1e-9 * ratio.max(1.0), "{v}");
        assert!(v["receiver_peak_rss_bytes"].as_u64().unwrap() > 0, "{v}");
    }
    let latency = lines.last().unwrap();
    assert!(latency["p50_us"].as_f64().unwrap() > 0.0, "{latency}");
    assert!(
        latency["p99_us"].as_f64().unwrap() >= latency["p50_us"].as_f64().unwrap(),
        "{latency}"
    );
}
