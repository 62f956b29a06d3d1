//! A decode rank registering with this prefill: the protocol version, the handshake checks and
//! the pair's plan, the transport connected, then the answer (accepted, or every problem).

use std::sync::Arc;

use kvbridge_handshake::check_with;
use kvbridge_transport::KvTransport;

use super::{AcceptedPeer, PrefillInner, problem};
use crate::memory::EntryRegion;
use crate::messages::{
    CONTROL_PROTOCOL_VERSION, ControlMessage, Registration, RegistrationOutcome, RegistrationReply,
    WireProblem, WireRegion, render_problems,
};
use crate::state::FailureCause;
use crate::trace;
use kvbridge_machines::plan::PeerPlan;
use kvbridge_machines::prefill::{AcceptedDecode, Known, RankEvent};

impl PrefillInner {
    fn reply_rejected(&self, reg: &Registration, problems: Vec<WireProblem>) {
        tracing::warn!(
            decode = %reg.decode_endpoint,
            problems = %render_problems(&problems),
            "refusing an incompatible decode rank; still serving the others"
        );
        // The registration's `kv_register` span (the caller's).
        let span = tracing::Span::current();
        span.record("outcome", "rejected");
        trace::fail(
            &span,
            FailureCause::PeerRejected,
            &render_problems(&problems),
        );
        self.step(RankEvent::Rejected {
            endpoint: reg.decode_endpoint.clone(),
            session: reg.session,
            problems: problems.clone(),
        });
        self.reply(reg, RegistrationOutcome::Rejected { problems });
    }

    fn reply_accepted(&self, reg: &Registration) {
        let span = tracing::Span::current();
        span.record("outcome", "accepted");
        trace::ok(&span);
        let descriptor = self.descriptor.clone();
        self.reply(reg, RegistrationOutcome::Accepted { descriptor });
    }

    fn reply(&self, reg: &Registration, result: RegistrationOutcome) {
        self.outbox.send(
            &reg.decode_endpoint,
            ControlMessage::RegisterReply(RegistrationReply {
                protocol: CONTROL_PROTOCOL_VERSION,
                prefill_endpoint: self.endpoint.clone(),
                prefill_rank: self.unique_rank,
                session: reg.session,
                result,
            }),
        );
    }

    pub(super) async fn on_register(self: &Arc<Self>, reg: Registration) {
        if CONTROL_PROTOCOL_VERSION.negotiate(reg.protocol).is_none() {
            let p = problem(
                "KVB-PROTOCOL",
                format!(
                    "control protocol version mismatch: decode speaks {}, this prefill speaks {}",
                    reg.protocol, CONTROL_PROTOCOL_VERSION
                ),
                "run kvbridge releases of the same major version on both sides",
            );
            return self.reply_rejected(&reg, vec![p]);
        }
        // Same session again (the decode retried, or registers again after a refusal):
        // answer as before.
        let known = self.with_core(|c| c.machine.known(&reg.decode_endpoint, reg.session));
        match known {
            Known::Accepted => return self.reply_accepted(&reg),
            Known::Rejected(problems) => return self.reply_rejected(&reg, problems),
            Known::New => {}
        }
        let (plan, path) = match self.plan_for(&reg) {
            Ok(p) => p,
            Err(problems) => return self.reply_rejected(&reg, problems),
        };
        let peer = match self.connect(&reg).await {
            Ok(p) => p,
            Err(p) => return self.reply_rejected(&reg, vec![p]),
        };
        let conn = Arc::new(AcceptedPeer {
            endpoint: reg.decode_endpoint.clone(),
            session: reg.session,
            peer,
            plan,
            descriptor: reg.transport.descriptor.clone(),
        });
        // A concurrent twin of the same registration that won keeps its connection (ours is
        // closed); an earlier session of the rank (it restarted) fails its rooms and is
        // disconnected.
        let stepped = self.step(RankEvent::Registered {
            endpoint: reg.decode_endpoint.clone(),
            decode: AcceptedDecode {
                session: reg.session,
                peer,
                conn,
            },
        });
        for peer in stepped.disconnect {
            let _ = self.transport.disconnect(peer).await;
        }
        tracing::Span::current().record("path", path.as_str());
        tracing::info!(decode = %reg.decode_endpoint, path, "decode rank registered");
        self.reply_accepted(&reg);
    }

    /// Checks a registering decode rank against this one and plans the pair (with the path's
    /// name, for the log), or says every problem found.
    fn plan_for(
        &self,
        reg: &Registration,
    ) -> std::result::Result<(PeerPlan, String), Vec<WireProblem>> {
        let report = check_with(&self.descriptor, &reg.descriptor, &self.config.check);
        for w in &report.warnings {
            // E.g. KVB-W003: a decode of a newer minor version whose new fields this release
            // does not know; the pair still works.
            tracing::warn!(decode = %reg.decode_endpoint, code = %w.code, "{}", w.message);
        }
        let mut problems: Vec<WireProblem> =
            report.problems.iter().map(WireProblem::from).collect();
        if reg.transport.name != self.transport.name() {
            problems.push(problem(
                "KVB-TRANSPORT",
                format!(
                    "transport mismatch: the decode uses \"{}\", this prefill uses \"{}\"",
                    reg.transport.name,
                    self.transport.name()
                ),
                "start both sides with the same --transport",
            ));
        }
        let Some(m) = report.mapping.as_ref().filter(|_| problems.is_empty()) else {
            return Err(problems);
        };
        let wire = |entries: &[EntryRegion]| -> Vec<WireRegion> {
            entries.iter().map(|e| e.to_wire()).collect()
        };
        PeerPlan::new(
            m.path,
            &self.descriptor,
            &wire(&self.memory.kv),
            &wire(&self.memory.aux),
            &reg.descriptor,
            &reg.kv_regions,
            &reg.aux_regions,
        )
        .map(|p| (p, format!("{:?}", m.path)))
        .map_err(|e| {
            vec![problem(
                "KVB-PLAN",
                e.0,
                "register the decode's KV memory with the geometry its descriptor states",
            )]
        })
    }
}
