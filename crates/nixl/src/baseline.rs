//! The same-run baseline of `kvbridge-lab bench --transport nixl` (and of its `--e2e`): the same
//! descriptors posted through nixl-sys directly, on an agent of its own, with none of kvbridge
//! (no batch table, no control messages, no polling thread: it polls NIXL itself, in a tight
//! loop, as a program using NIXL alone would).
//!
//! The agent has no NIXL progress thread either: `Agent::new` would start one that polls
//! without sleeping (NIXL's default progress delay is zero), which burns a core for the whole
//! run, also while the transport is measured beside it, and so would hand the transport a
//! handicap the baseline does not pay (its own tight loop drives UCX's progress).

/// One descriptor of a direct write: `len` bytes at `src_offset` of source region `src` (an
/// index into the regions given to `DirectWriter::new`) to `dst_offset` of the peer's region
/// `region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirectOp {
    /// Index of the source region.
    pub src: usize,
    /// Offset in the source region.
    pub src_offset: u64,
    /// The peer's region id.
    pub region: u64,
    /// Offset in the peer's region.
    pub dst_offset: u64,
    /// Bytes.
    pub len: u64,
}

#[cfg(feature = "nixl")]
#[cfg_attr(docsrs, doc(cfg(feature = "nixl")))]
pub use writer::DirectWriter;

#[cfg(feature = "nixl")]
mod writer {
    use std::time::{Duration, Instant};

    use kvbridge_transport::{MemoryRegion, Result, TransportError};
    use nixl_sys::{
        Agent, AgentConfig, Backend, MemType, OptArgs, RegistrationHandle, XferDescList, XferOp,
        XferRequest, XferStatus,
    };

    use super::DirectOp;
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

    /// A loaded peer: its NIXL agent name and its region table.
    struct DirectPeer {
        name: String,
        regions: Vec<RemoteRegion>,
    }

    /// A raw NIXL agent that writes local regions into kvbridge-nixl peers' regions.
    pub struct DirectWriter {
        agent: Agent,
        backend: Backend,
        peers: Vec<DirectPeer>,
        srcs: Vec<Segment>,
        _registrations: Vec<RegistrationHandle>,
        _srcs: Vec<MemoryRegion>,
    }

    impl std::fmt::Debug for DirectWriter {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("DirectWriter")
                .field(
                    "peers",
                    &self.peers.iter().map(|p| &p.name).collect::<Vec<_>>(),
                )
                .field("sources", &self.srcs.len())
                .finish()
        }
    }

    impl DirectWriter {
        /// An agent that registers `srcs` and loads each peer's metadata from its kvbridge-nixl
        /// descriptor.
        pub fn new(srcs: &[MemoryRegion], peers: &[&[u8]]) -> Result<Self> {
            ffi::load(&Runtime::locate()?)?;
            let name = format!(
                "kvbridge-direct-{}-{}",
                std::process::id(),
                NEXT_AGENT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            );
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
            let mut segments = Vec::with_capacity(srcs.len());
            let mut registrations = Vec::with_capacity(srcs.len());
            for src in srcs {
                let seg = Segment::of(src);
                registrations.push(
                    agent
                        .register_memory(&seg, None)
                        .map_err(|e| failed("registerMem", e))?,
                );
                segments.push(seg);
            }
            let mut loaded = Vec::with_capacity(peers.len());
            for descriptor in peers {
                let d = Descriptor::decode(descriptor).map_err(|message| {
                    TransportError::BadDescriptor {
                        transport: NAME,
                        message,
                    }
                })?;
                let name = agent
                    .load_remote_md(&d.metadata)
                    .map_err(|e| failed("loadRemoteMD", e))?;
                loaded.push(DirectPeer {
                    name,
                    regions: d.regions,
                });
            }
            Ok(Self {
                agent,
                backend,
                peers: loaded,
                srcs: segments,
                _registrations: registrations,
                _srcs: srcs.to_vec(),
            })
        }

        /// Writes `ops[i]` to peer `i` (as given to [`new`](Self::new)) as one NIXL transfer each
        /// (with `notification`, if any; an empty list is skipped), posts them all, then polls them
        /// to completion; returns the time from building the first request to the last completion.
        pub fn write(
            &self,
            ops: &[Vec<DirectOp>],
            notification: Option<&[u8]>,
        ) -> Result<Duration> {
            let start = Instant::now();
            let mut reqs = Vec::with_capacity(ops.len());
            for (peer, ops) in self.peers.iter().zip(ops) {
                if !ops.is_empty() {
                    reqs.push(self.post(peer, ops, notification)?);
                }
            }
            for req in &reqs {
                loop {
                    match self.agent.get_xfer_status(req) {
                        Ok(XferStatus::Success) => break,
                        Ok(XferStatus::InProgress) => std::hint::spin_loop(),
                        Err(e) => return Err(failed("getXferStatus", e)),
                    }
                }
            }
            Ok(start.elapsed())
        }

        fn post(
            &self,
            peer: &DirectPeer,
            ops: &[DirectOp],
            notification: Option<&[u8]>,
        ) -> Result<XferRequest> {
            let bad = |message: String| TransportError::InvalidArgument {
                transport: NAME,
                message,
            };
            let mut local =
                XferDescList::new(MemType::Dram).map_err(|e| failed("createXferDlist", e))?;
            let mut remote =
                XferDescList::new(MemType::Dram).map_err(|e| failed("createXferDlist", e))?;
            for op in ops {
                let r = peer
                    .regions
                    .iter()
                    .find(|r| r.id == op.region)
                    .ok_or_else(|| bad(format!("the peer has no region {}", op.region)))?;
                let src = self
                    .srcs
                    .get(op.src)
                    .ok_or_else(|| bad(format!("there is no source region {}", op.src)))?;
                let fits = |at: u64, len: u64| at.checked_add(op.len).is_some_and(|e| e <= len);
                if !fits(op.src_offset, src.len as u64) || !fits(op.dst_offset, r.len) {
                    return Err(bad(format!("descriptor {op:?} is out of bounds")));
                }
                local.add_desc(src.addr + op.src_offset as usize, op.len as usize, 0);
                remote.add_desc((r.addr + op.dst_offset) as usize, op.len as usize, 0);
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
                .create_xfer_req(XferOp::Write, &local, &remote, &peer.name, Some(&args))
                .map_err(|e| failed("createXferReq", e))?;
            self.agent
                .post_xfer_req(&req, None)
                .map_err(|e| failed("postXferReq", e))?;
            Ok(req)
        }
    }

    /// Agent names must differ within a process (a bench may run several direct writers).
    static NEXT_AGENT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
}
