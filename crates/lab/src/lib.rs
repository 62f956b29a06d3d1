//! kvbridge's lab: what the demo and the benchmarks share. Never published; no product crate
//! depends on it (tidy checks), and neither does any crate it depends on, even for its tests
//! (fill and verify live below the coordinator, in `kvbridge-testkit`).
//!
//! * [`views`] — the fill views (`kvbridge_testkit::fill::EntryView`) of the memory the
//!   coordinator allocated.
//! * [`process`] — the one process orchestrator of `kvbridge-lab demo` and `kvbridge-lab
//!   bench`: both run this binary again as their other processes (prefill, decode ranks, the
//!   bench's receiver and sinks), read their JSON lines, and end each by its process id within a
//!   bound, removing what a killed process could not.
//!
//! The binary (`src/main.rs`) holds the two commands: `demo` and `bench`.

pub mod process;
pub mod telemetry;
pub mod views;
