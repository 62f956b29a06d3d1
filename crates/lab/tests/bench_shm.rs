//! A quick smoke run of `kvbridge-lab bench --transport shm`: tiny sizes, one run, JSON output.

mod common;

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
    let lines = common::bench_json("shm");
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
