//! What the `kvbridge-lab bench` smoke tests share.

#![allow(unreachable_pub)]

use std::process::Command;

/// The patterns every bench run measures, in order.
pub const PATTERNS: [&str; 6] = [
    "large",
    "scatter-64k",
    "scatter-72k",
    "scatter-16k",
    "strided-1152",
    "latency-4k",
];

/// Runs `kvbridge-lab bench --transport <transport> --json` at tiny sizes, once; asserts it
/// succeeded and printed one JSON object per pattern of [`PATTERNS`], in order, and returns
/// them.
pub fn bench_json(transport: &str) -> Vec<serde_json::Value> {
    let out = Command::new(env!("CARGO_BIN_EXE_kvbridge-lab"))
        .args([
            "bench",
            "--transport",
            transport,
            "--json",
            "--runs",
            "1",
            "--size-scale",
            "0.001",
        ])
        .output()
        .expect("run kvbridge-lab bench");
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
    assert_eq!(patterns, PATTERNS);
    lines
}
