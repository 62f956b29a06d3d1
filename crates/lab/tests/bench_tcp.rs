//! A quick smoke run of `kvbridge-lab bench --transport tcp`: tiny sizes, one run, JSON output, the
//! raw-TCP baseline (one and two streams into the receiver's pool; for strided ops, the
//! transport's own large block) measured in the same run.

mod common;

#[test]
fn tcp_bench_measures_every_pattern_against_raw_tcp() {
    let lines = common::bench_json("tcp");
    for v in &lines {
        assert_eq!(v["transport"], "tcp", "{v}");
        assert_eq!(v["verified"], true, "{v}");
        // Strided ops are compared with the transport's own large blocks, the rest with a raw
        // TCP stream.
        let against = if v["pattern"] == "strided-1152" {
            "one large block"
        } else {
            "raw TCP"
        };
        assert!(
            v["baseline"].as_str().unwrap().contains(against),
            "the TCP bench compares {} against {against}: {v}",
            v["pattern"]
        );
        // Bulk patterns: the raw streams run as one and as two streams, each count's median
        // reported.
        if v["pattern"] != "strided-1152" && v["pattern"] != "latency-4k" {
            let streams = v["raw_tcp_streams"].as_str().unwrap_or_default();
            assert!(
                streams.contains("1 stream ") && streams.contains("2 streams "),
                "{v}"
            );
        }
        let gbps = v["gbps"].as_f64().unwrap();
        let base = v["baseline_gbps"].as_f64().unwrap();
        assert!(gbps > 0.0 && base > 0.0, "{v}");
        assert!(v["receiver_peak_rss_bytes"].as_u64().unwrap() > 0, "{v}");
    }
}
