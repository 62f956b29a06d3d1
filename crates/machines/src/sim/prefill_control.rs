//! What a prefill agent does with the control messages it gets (`PrefillInner::handle` in
//! the coordinator's `prefill/mod.rs`, with `registration.rs` and `metadata.rs` beside it):
//! registrations (the same session answered as before, a new one connected first), metadata
//! (checked against the registration, a lost connection connected again first, each on a task
//! of its own), aborts and pings.

use kvbridge_transport::PeerId;

use super::prefill_node::SimConn;
use super::schedule::PAGE_TOKENS;
use super::world::{Ev, World};
use crate::prefill::{AcceptedDecode, Known, RankEvent, status_message};
use crate::{FailureCause, FailureReason, RoomState};
use kvbridge_control::Endpoint;
use kvbridge_control::{
    CONTROL_PROTOCOL_VERSION, ControlMessage, Registration, RegistrationOutcome, RegistrationReply,
    TransferInfo, WireProblem,
};

/// Why metadata cannot be served: a prefix that does not start at a page.
fn check_info(info: &TransferInfo) -> Option<FailureReason> {
    (!info.is_dummy && info.decode_prefix_len % PAGE_TOKENS != 0).then(|| {
        FailureReason::with_peer(
            FailureCause::Planning,
            &info.decode_endpoint,
            format!(
                "the decode prefix {} is not a multiple of the page ({PAGE_TOKENS} tokens)",
                info.decode_prefix_len
            ),
        )
    })
}

impl World {
    pub(super) fn prefill_receive(&mut self, p: usize, from: Endpoint, message: ControlMessage) {
        match message {
            ControlMessage::Register(reg) => self.on_register(p, reg),
            ControlMessage::TransferInfo(info) => self.on_transfer_info(p, info),
            ControlMessage::Abort(a) => self.prefill_step(p, RankEvent::DecodeAbort(a)),
            ControlMessage::Ping(h) => {
                let me = self.prefills[p].endpoint.clone();
                self.send(&me, from, ControlMessage::Pong(h));
            }
            _ => {}
        }
    }

    /// A registration: the same session is answered as before; a new one is connected first
    /// (a task of its own: other messages go on meanwhile).
    fn on_register(&mut self, p: usize, reg: Registration) {
        let n = &self.prefills[p];
        match n.machine.known(&reg.decode_endpoint, reg.session) {
            Known::Accepted => {
                let descriptor = n.descriptor.clone();
                self.reply(p, &reg, RegistrationOutcome::Accepted { descriptor });
            }
            Known::Rejected(problems) => self.reply_rejected(p, &reg, problems),
            Known::New => {
                let (epoch, after) = (n.epoch, self.rng.millis(1, 20));
                let registration = Box::new(reg);
                self.schedule(
                    after,
                    Ev::Connected {
                        p,
                        epoch,
                        registration,
                    },
                );
            }
        }
    }

    pub(super) fn connected(&mut self, p: usize, epoch: u32, reg: Registration) {
        if self.prefills[p].epoch != epoch {
            return; // the task died with its process
        }
        let Some((d, decode_epoch)) = super::parse_transport(&reg.transport.descriptor) else {
            return;
        };
        match self.connect(p, d, decode_epoch) {
            Ok(peer) => {
                let conn = SimConn {
                    decode: d,
                    decode_epoch,
                    session: reg.session,
                    peer,
                };
                let decode = AcceptedDecode {
                    session: reg.session,
                    peer,
                    conn,
                };
                let endpoint = reg.decode_endpoint.clone();
                self.prefill_step(p, RankEvent::Registered { endpoint, decode });
                let descriptor = self.prefills[p].descriptor.clone();
                self.reply(p, &reg, RegistrationOutcome::Accepted { descriptor });
            }
            Err(why) => {
                let problem = WireProblem {
                    code: "KVB-CONNECT".to_owned(),
                    message: why,
                    remedy: "check the decode's transport is reachable".to_owned(),
                };
                self.reply_rejected(p, &reg, vec![problem]);
            }
        }
    }

    /// Connects the transport of prefill `p` to decode `d`'s process `decode_epoch`: refused
    /// once that process is gone, and now and then for no reason.
    fn connect(&mut self, p: usize, d: usize, decode_epoch: u32) -> Result<PeerId, String> {
        if self.decodes[d].epoch != decode_epoch {
            return Err(format!("decode-{d} process {decode_epoch} is gone"));
        }
        if self.rng.chance(self.knobs.p_connect_fails) {
            return Err(format!("connecting to decode-{d} timed out"));
        }
        let epoch = self.prefills[p].epoch;
        Ok(self.transport.open((p, epoch), (d, decode_epoch)))
    }

    fn reply_rejected(&mut self, p: usize, reg: &Registration, problems: Vec<WireProblem>) {
        let event = RankEvent::Rejected {
            endpoint: reg.decode_endpoint.clone(),
            session: reg.session,
            problems: problems.clone(),
        };
        self.prefill_step(p, event);
        self.reply(p, reg, RegistrationOutcome::Rejected { problems });
    }

    fn reply(&mut self, p: usize, reg: &Registration, result: RegistrationOutcome) {
        let n = &self.prefills[p];
        let message = ControlMessage::RegisterReply(RegistrationReply {
            protocol: CONTROL_PROTOCOL_VERSION,
            prefill_endpoint: n.endpoint.clone(),
            prefill_rank: n.rank,
            session: reg.session,
            result,
        });
        let from = n.endpoint.clone();
        self.send(&from, reg.decode_endpoint.clone(), message);
    }

    fn reply_failed(&mut self, p: usize, info: &TransferInfo, reason: &FailureReason) {
        let n = &self.prefills[p];
        let message = status_message(info.room, info, n.rank, RoomState::Failed, Some(reason));
        let from = n.endpoint.clone();
        self.send(&from, info.decode_endpoint.clone(), message);
    }

    /// Metadata: checked against the registration; a lost connection is connected again
    /// first (a task of its own, so other messages may overtake it).
    fn on_transfer_info(&mut self, p: usize, info: TransferInfo) {
        let n = &self.prefills[p];
        let conn = match n.machine.sender(&info) {
            Ok(a) => a.conn.clone(),
            Err(reason) => return self.reply_failed(p, &info, &reason),
        };
        if !info.is_dummy && n.machine.is_lost(conn.peer) {
            let (epoch, after) = (n.epoch, self.rng.millis(1, 20));
            let info = Box::new(info);
            let ev = Ev::Reconnected {
                p,
                epoch,
                info,
                old: conn,
            };
            return self.schedule(after, ev);
        }
        if n.machine.room(info.room).is_none() {
            self.stats.early_metadata += 1;
        }
        let invalid = check_info(&info);
        let conn = (!info.is_dummy).then_some(conn);
        let event = RankEvent::Metadata {
            info,
            conn,
            invalid,
        };
        self.prefill_step(p, event);
    }

    pub(super) fn reconnected(&mut self, p: usize, epoch: u32, info: TransferInfo, old: &SimConn) {
        if self.prefills[p].epoch != epoch {
            return;
        }
        self.stats.reconnects += 1;
        match self.reconnect(p, old) {
            Ok(_) => self.on_transfer_info(p, info),
            Err(why) => {
                let reason = FailureReason::with_peer(
                    FailureCause::TransferError,
                    &info.decode_endpoint,
                    format!("room {}: {why}", info.room),
                );
                self.reply_failed(p, &info, &reason);
            }
        }
    }

    /// Connects again to `old`'s decode rank (its connection was lost) and puts the new
    /// connection in its place, unless a reconnect or a new registration replaced it first.
    pub(super) fn reconnect(&mut self, p: usize, old: &SimConn) -> Result<SimConn, String> {
        let endpoint = self.decodes[old.decode].endpoint.clone();
        let m = &self.prefills[p].machine;
        if let Some(a) = m.replacement(&endpoint, old.peer, old.session) {
            return Ok(a.conn.clone());
        }
        let peer = self.connect(p, old.decode, old.decode_epoch).map_err(|why| {
            format!("the connection to decode {endpoint} was lost, and connecting again failed: {why}")
        })?;
        let fresh = SimConn {
            peer,
            ..old.clone()
        };
        let decode = AcceptedDecode {
            session: old.session,
            peer,
            conn: fresh.clone(),
        };
        match self.prefills[p]
            .machine
            .replace_lost(&endpoint, old.peer, decode)
        {
            Ok(()) => {
                self.disconnect(old.peer);
                Ok(fresh)
            }
            Err(other) => {
                self.disconnect(peer);
                other.map(|a| a.conn).ok_or_else(|| {
                    format!(
                        "decode {endpoint} registered again while its lost connection was replaced"
                    )
                })
            }
        }
    }
}
