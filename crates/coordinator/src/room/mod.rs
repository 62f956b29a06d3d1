//! The rooms' lifecycles as plain state machines (docs/lifecycle.md).
//!
//! A machine holds one room's lifecycle on one agent and nothing else: no tasks, no channels,
//! no clock, no I/O. Its driver (the agent) feeds it events with the current instant —
//! `handle(event, now)` — and executes the actions it answers (send a control message, post a
//! chunk, cancel the batches in flight, report the state), and calls `handle` again with the
//! timer event once `poll_timeout()` has passed. So every lifecycle rule can be tested by
//! driving a machine step by step with explicit instants.

pub(crate) mod decode;
pub(crate) mod prefill;
