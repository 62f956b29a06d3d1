//! A quick smoke run of `kvbridge bench --transport tcp`: tiny sizes, one run, JSON output, the
//! raw-TCP baseline measured in the same run.

use std::process::Command;

#[test]
fn tcp_bench_measures_every_pattern_against_raw_tcp() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge"))
        .args([
            "bench",
            "--transport",
            "tcp",
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
        assert_eq!(v["transport"], "tcp", "{v}");
        assert_eq!(v["verified"], true, "{v}");
        assert!(
            v["baseline"].as_str().unwrap().contains("raw TCP"),
            "the TCP bench compares against a raw TCP stream: {v}"
        );
        let gbps = v["gbps"].as_f64().unwrap();
        let base = v["baseline_gbps"].as_f64().unwrap();
        assert!(gbps > 0.0 && base > 0.0, "{v}");
        assert!(v["receiver_peak_rss_bytes"].as_u64().unwrap() > 0, "{v}");
    }
}
