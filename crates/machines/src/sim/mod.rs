//! A deterministic simulation of the room machines together: several prefill ranks
//! ([`PrefillMachine`](crate::prefill::PrefillMachine)) and decode ranks
//! ([`DecodeMachine`](crate::decode::DecodeMachine)) with tens of rooms, and around them,
//! in plain synchronous code on a virtual clock, what the agents and the world do: the
//! drivers (`prefill/`, `decode.rs`), a transport, a control channel, a directory and the
//! callers. Faults come from the seed: delayed, dropped, duplicated messages, batches that
//! fail, lose their peer or hang, cancels that hang or fail, processes that restart, callers
//! that abort or clear at random, rooms created on one side long before the other, or never.
//!
//! Each schedule is checked against the promises of docs/lifecycle.md
//! ([`Invariant`](checks::Invariant)). A schedule is a function of its seed alone (no clock
//! read but the base instant, no hash map order), so a failure replays from its seed:
//! `KVBRIDGE_SIM_SEED=<seed> cargo test -p kvbridge-machines --lib sim`.

mod checks;
mod decode_node;
mod driver;
mod prefill_control;
mod prefill_node;
mod rng;
mod schedule;
mod transport;
mod world;

mod tests;

use kvbridge_control::ControlMessage;

/// The transport descriptor a decode process registers: its index and process epoch, so a
/// connection made to an earlier process of the rank reaches nobody.
fn transport_descriptor(decode: usize, epoch: u32) -> Vec<u8> {
    format!("{decode}/{epoch}").into_bytes()
}

fn parse_transport(descriptor: &[u8]) -> Option<(usize, u32)> {
    let s = std::str::from_utf8(descriptor).ok()?;
    let (d, e) = s.split_once('/')?;
    Some((d.parse().ok()?, e.parse().ok()?))
}

/// A message in a trace line, without the large registration fields.
fn summarize(message: &ControlMessage) -> String {
    match message {
        ControlMessage::Register(r) => format!("register (session {})", r.session),
        ControlMessage::RegisterReply(r) => {
            let outcome = match &r.result {
                kvbridge_control::RegistrationOutcome::Accepted { .. } => "accepted",
                kvbridge_control::RegistrationOutcome::Rejected { .. } => "rejected",
            };
            format!("register_reply {outcome} (session {})", r.session)
        }
        ControlMessage::TransferInfo(t) => format!(
            "transfer_info room {} generation {} (dummy {}, prefix {}, pages {:?})",
            t.room, t.generation, t.is_dummy, t.decode_prefix_len, t.dst_pages
        ),
        ControlMessage::Status(s) => format!(
            "status room {} generation {} {} {:?}",
            s.room, s.generation, s.state, s.cause
        ),
        ControlMessage::Abort(a) => format!("abort room {} generation {}", a.room, a.generation),
        ControlMessage::AbortAck(a) => {
            format!("abort_ack room {} generation {}", a.room, a.generation)
        }
        ControlMessage::Ping(h) => format!("ping {}", h.nonce),
        ControlMessage::Pong(h) => format!("pong {}", h.nonce),
    }
}
