//! The same-run baseline of `kvbridge bench --transport nixl`: the same descriptors posted
//! through nixl-sys directly, on an agent of its own, with none of kvbridge (no batch table, no
//! control messages, no polling thread: it polls NIXL itself, in a tight loop, as a program
//! using NIXL alone would).
//!
//! The agent has no NIXL progress thread either: `Agent::new` would start one that polls
//! without sleeping (NIXL's default progress delay is zero), which burns a core for the whole
//! run, also while the transport is measured beside it, and so would hand the transport a
//! handicap the baseline does not pay (its own tight loop drives UCX's progress).

use std::time::{Duration, Instant};

use kvbridge_transport::{MemoryRegion, Result, TransportError};
use nixl_sys::{
    Agent, AgentConfig, Backend, MemType, OptArgs, RegistrationHandle, XferDescList, XferOp,
    XferStatus,
};

use crate::descriptor::{Descriptor, RemoteRegion};
use crate::ffi::{self, Segment};
use crate::runtime::Runtime;
use crate::{NAME, NixlError};

fn failed(call: &'static str, e: nixl_sys::NixlError) -> TransportError {
    NixlError::Call {
        call,
        status: format!("{e:?}"),
        remedy: "the direct NIXL baseline failed; check the receiver process",
    }
    .into()
}

/// A raw NIXL agent that writes one local region into a kvbridge-nixl peer's regions.
pub struct DirectWriter {
    agent: Agent,
    backend: Backend,
    peer: String,
    src: Segment,
    regions: Vec<RemoteRegion>,
    _registration: RegistrationHandle,
    _src: MemoryRegion,
}

impl std::fmt::Debug for DirectWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DirectWriter")
            .field("peer", &self.peer)
            .finish()
    }
}

impl DirectWriter {
    /// An agent that registers `src` and loads the peer's metadata from its kvbridge-nixl
    /// descriptor.
    pub fn new(src: &MemoryRegion, descriptor: &[u8]) -> Result<Self> {
        ffi::load(&Runtime::locate()?)?;
        let d =
            Descriptor::decode(descriptor).map_err(|message| TransportError::BadDescriptor {
                transport: NAME,
                message,
            })?;
        let name = format!("kvbridge-direct-{}", std::process::id());
        let cfg = AgentConfig {
            enable_prog_thread: false,
            ..AgentConfig::default()
        };
        let agent = Agent::new_configured(&name, &cfg).map_err(|e| failed("createAgent", e))?;
        let (_mems, params) = agent
            .get_plugin_params("UCX")
            .map_err(|e| failed("getPluginParams", e))?;
        let backend = agent
            .create_backend("UCX", &params)
            .map_err(|e| failed("createBackend", e))?;
        let seg = Segment::of(src);
        let registration = agent
            .register_memory(&seg, None)
            .map_err(|e| failed("registerMem", e))?;
        let peer = agent
            .load_remote_md(&d.metadata)
            .map_err(|e| failed("loadRemoteMD", e))?;
        Ok(Self {
            agent,
            backend,
            peer,
            src: seg,
            regions: d.regions,
            _registration: registration,
            _src: src.clone(),
        })
    }

    /// Writes `(source offset, peer region, destination offset, len)` descriptors as one NIXL
    /// transfer (with `notification`, if any) and polls it to completion; returns the time from
    /// building the request to its completion.
    pub fn write(
        &self,
        ops: &[(u64, u64, u64, u64)],
        notification: Option<&[u8]>,
    ) -> Result<Duration> {
        let start = Instant::now();
        let bad = |message: String| TransportError::InvalidArgument {
            transport: NAME,
            message,
        };
        let mut local =
            XferDescList::new(MemType::Dram).map_err(|e| failed("createXferDlist", e))?;
        let mut remote =
            XferDescList::new(MemType::Dram).map_err(|e| failed("createXferDlist", e))?;
        for &(s, region, d, len) in ops {
            let r = self
                .regions
                .iter()
                .find(|r| r.id == region)
                .ok_or_else(|| bad(format!("the peer has no region {region}")))?;
            if s + len > self.src.len as u64 || d + len > r.len {
                return Err(bad(format!(
                    "descriptor ({s}, {region}, {d}, {len}) is out of bounds"
                )));
            }
            local.add_desc(self.src.addr + s as usize, len as usize, 0);
            remote.add_desc((r.addr + d) as usize, len as usize, 0);
        }
        let mut args = OptArgs::new().map_err(|e| failed("createOptArgs", e))?;
        args.add_backend(&self.backend)
            .map_err(|e| failed("addBackend", e))?;
        if let Some(n) = notification {
            // Tagged as a caller's notification, so a kvbridge-nixl receiver delivers it.
            let msg = crate::control::Control::User(n.to_vec()).encode();
            args.set_has_notification(true)
                .map_err(|e| failed("setNotif", e))?;
            args.set_notification_message(&msg)
                .map_err(|e| failed("setNotif", e))?;
        }
        let req = self
            .agent
            .create_xfer_req(XferOp::Write, &local, &remote, &self.peer, Some(&args))
            .map_err(|e| failed("createXferReq", e))?;
        self.agent
            .post_xfer_req(&req, None)
            .map_err(|e| failed("postXferReq", e))?;
        loop {
            match self.agent.get_xfer_status(&req) {
                Ok(XferStatus::Success) => return Ok(start.elapsed()),
                Ok(XferStatus::InProgress) => std::hint::spin_loop(),
                Err(e) => return Err(failed("getXferStatus", e)),
            }
        }
    }
}
