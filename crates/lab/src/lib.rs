//! kvbridge's lab: what the demo, the benchmarks and kvbridge's own tests use to show that every
//! byte lands where it must. Never published; no product crate depends on it (tidy checks).
//!
//! * [`fill`] — fill prefill memory with bytes derived from (request, entry, position) and
//!   verify every byte a decode rank holds against the owner rule.
//! * [`process`] — the one process orchestrator of `kvbridge-lab demo` and `kvbridge-lab
//!   bench`: both run this binary again as their other processes (prefill, decode ranks, the
//!   bench's receiver and sinks), read their JSON lines, and end each by its process id within a
//!   bound, removing what a killed process could not.
//!
//! The binary (`src/main.rs`) holds the two commands: `demo` and `bench`.

pub mod fill;
pub mod process;
