//! The typed Python exceptions: `KvbridgeError` and one subclass per kind of transport or
//! coordinator failure, each carrying the Rust message (what was wrong, the values seen, the
//! remedy).
//!
//! The classes are made at import with `type(name, bases, ns)` so that each also derives from
//! the builtin a Python caller would catch (`InvalidArgumentError` is a `ValueError`,
//! `TimedOutError` a `TimeoutError`, `IoError` an `OSError`); `create_exception!` allows one
//! base only.

use kvbridge_coordinator::{ControlError, CoordinatorError};
use kvbridge_transport::TransportError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// One exception class: its name, the builtin it also derives from, its docstring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The base of every kvbridge exception.
    Base,
    OutOfBounds,
    UnknownRegion,
    UnknownPeer,
    UnknownBatch,
    Unsupported,
    InvalidArgument,
    BadDescriptor,
    TimedOut,
    Cancelled,
    BatchFailed,
    PeerLost,
    Protocol,
    Closed,
    Io,
    MemoryAccess,
    Transfer,
    Room,
}

const KINDS: [Kind; 18] = [
    Kind::Base,
    Kind::OutOfBounds,
    Kind::UnknownRegion,
    Kind::UnknownPeer,
    Kind::UnknownBatch,
    Kind::Unsupported,
    Kind::InvalidArgument,
    Kind::BadDescriptor,
    Kind::TimedOut,
    Kind::Cancelled,
    Kind::BatchFailed,
    Kind::PeerLost,
    Kind::Protocol,
    Kind::Closed,
    Kind::Io,
    Kind::MemoryAccess,
    Kind::Transfer,
    Kind::Room,
];

impl Kind {
    fn spec(self) -> (&'static str, Option<&'static str>, &'static str) {
        match self {
            Kind::Base => (
                "KvbridgeError",
                None,
                "Base of every kvbridge error; the message says what was wrong, the values \
                 seen and how to fix it.",
            ),
            Kind::OutOfBounds => (
                "OutOfBoundsError",
                Some("IndexError"),
                "A descriptor addresses bytes outside its registered region; nothing moved.",
            ),
            Kind::UnknownRegion => (
                "UnknownRegionError",
                Some("LookupError"),
                "A region id that is not registered (locally or on the peer).",
            ),
            Kind::UnknownPeer => (
                "UnknownPeerError",
                Some("LookupError"),
                "A peer that is not connected.",
            ),
            Kind::UnknownBatch => (
                "UnknownBatchError",
                Some("LookupError"),
                "A batch id that is unknown (already collected, or never posted).",
            ),
            Kind::Unsupported => (
                "UnsupportedError",
                None,
                "The transport lacks what the call needs (device memory, reads, NIXL).",
            ),
            Kind::InvalidArgument => (
                "InvalidArgumentError",
                Some("ValueError"),
                "An argument that cannot work: wrong dtype or shape, a negative length, a \
                 pointer range that overflows, a bad descriptor or configuration.",
            ),
            Kind::BadDescriptor => (
                "BadDescriptorError",
                Some("ValueError"),
                "Bytes passed to connect() that are not the peer's local_descriptor().",
            ),
            Kind::TimedOut => (
                "TimedOutError",
                Some("TimeoutError"),
                "A transfer (or a fence) did not end by its deadline; no byte of it lands later.",
            ),
            Kind::Cancelled => (
                "CancelledError",
                None,
                "The transfer was cancelled; no byte of it lands later.",
            ),
            Kind::BatchFailed => (
                "BatchFailedError",
                None,
                "The transfer failed; no byte of it lands later.",
            ),
            Kind::PeerLost => (
                "PeerLostError",
                Some("ConnectionError"),
                "The peer died, disconnected or stopped answering.",
            ),
            Kind::Protocol => (
                "ProtocolError",
                Some("ConnectionError"),
                "The peer broke the protocol; the connection was closed.",
            ),
            Kind::Closed => (
                "ClosedError",
                None,
                "The engine or agent was closed; create a new one.",
            ),
            Kind::Io => (
                "IoError",
                Some("OSError"),
                "An operating-system error, with what was being done.",
            ),
            Kind::MemoryAccess => (
                "MemoryAccessError",
                None,
                "A CPU access to registered memory was refused (out of range, conflicting, \
                 device memory).",
            ),
            Kind::Transfer => (
                "KVTransferError",
                None,
                "A room failed; the text is SGLang's `KVTransferError(bootstrap_room=...)`.",
            ),
            Kind::Room => (
                "RoomError",
                Some("ValueError"),
                "A room operation that cannot work now: unknown or duplicate room, a state the \
                 room is not in yet.",
            ),
        }
    }

    fn index(self) -> usize {
        KINDS.iter().position(|k| *k == self).unwrap_or(0)
    }

    /// A Python exception of this kind carrying `message`.
    pub(crate) fn err(self, message: impl Into<String>) -> PyErr {
        let message = message.into();
        Python::attach(|py| match classes(py) {
            Ok(classes) => PyErr::from_type(classes[self.index()].bind(py).clone(), message),
            Err(e) => e,
        })
    }
}

static CLASSES: PyOnceLock<Vec<Py<PyType>>> = PyOnceLock::new();

fn classes(py: Python<'_>) -> PyResult<&'static Vec<Py<PyType>>> {
    CLASSES.get_or_try_init(py, || {
        let builtins = py.import("builtins")?;
        let type_ = builtins.getattr("type")?;
        let mut out: Vec<Py<PyType>> = Vec::with_capacity(KINDS.len());
        for kind in KINDS {
            let (name, builtin, doc) = kind.spec();
            let first = match kind {
                Kind::Base => builtins.getattr("Exception")?,
                _ => out[0].bind(py).clone().into_any(),
            };
            let bases = match builtin {
                Some(b) => PyTuple::new(py, [first, builtins.getattr(b)?])?,
                None => PyTuple::new(py, [first])?,
            };
            let ns = PyDict::new(py);
            ns.set_item("__doc__", doc)?;
            ns.set_item("__module__", "kvbridge")?;
            let class = type_.call1((name, bases, ns))?.cast_into::<PyType>()?;
            out.push(class.unbind());
        }
        Ok(out)
    })
}

/// Adds every exception class to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    for class in classes(m.py())? {
        let class = class.bind(m.py());
        m.add(class.name()?, class)?;
    }
    Ok(())
}

/// The Python exception for a transport error, by its kind.
pub(crate) fn transport(e: TransportError) -> PyErr {
    let (kind, message) = describe(&e);
    kind.err(message)
}

/// The kind and full message of a transport error (to raise it later, or more than once).
pub(crate) fn describe(e: &TransportError) -> (Kind, String) {
    (transport_kind(e), error_chain(e))
}

/// The Python exception for a coordinator error; transport failures keep their kind.
pub(crate) fn coordinator(e: CoordinatorError) -> PyErr {
    let kind = match &e {
        CoordinatorError::Transport { source, .. } => {
            return transport_kind(source).err(error_chain(&e));
        }
        CoordinatorError::Transfer(_) => Kind::Transfer,
        CoordinatorError::UnknownRoom { .. }
        | CoordinatorError::DuplicateRoom { .. }
        | CoordinatorError::RoomNotReady { .. } => Kind::Room,
        CoordinatorError::InvalidRequest { .. } | CoordinatorError::InvalidSetup { .. } => {
            Kind::InvalidArgument
        }
        CoordinatorError::FenceTimeout { .. } => Kind::TimedOut,
        CoordinatorError::Shutdown { .. } => Kind::Closed,
        CoordinatorError::Control(
            ControlError::Send { .. }
            | ControlError::UnknownEndpoint { .. }
            | ControlError::SendTimeout { .. },
        )
        | CoordinatorError::Bootstrap(_) => Kind::PeerLost,
        CoordinatorError::Control(ControlError::Closed { .. }) => Kind::Closed,
        CoordinatorError::Control(
            ControlError::Protocol { .. } | ControlError::VersionMismatch { .. },
        ) => Kind::Protocol,
        CoordinatorError::Control(ControlError::InvalidConfig { .. }) => Kind::InvalidArgument,
        _ => Kind::Base,
    };
    kind.err(error_chain(&e))
}

fn transport_kind(e: &TransportError) -> Kind {
    match e {
        TransportError::OutOfBounds { .. } => Kind::OutOfBounds,
        TransportError::UnknownRegion { .. } => Kind::UnknownRegion,
        TransportError::UnknownPeer { .. } => Kind::UnknownPeer,
        TransportError::UnknownBatch { .. } => Kind::UnknownBatch,
        TransportError::Unsupported { .. } => Kind::Unsupported,
        TransportError::InvalidArgument { .. } => Kind::InvalidArgument,
        TransportError::BadDescriptor { .. } => Kind::BadDescriptor,
        TransportError::TimedOut { .. } => Kind::TimedOut,
        TransportError::Cancelled { .. } => Kind::Cancelled,
        TransportError::BatchFailed { .. } => Kind::BatchFailed,
        TransportError::PeerLost { .. } => Kind::PeerLost,
        TransportError::Protocol { .. } => Kind::Protocol,
        TransportError::Closed { .. } => Kind::Closed,
        TransportError::Io { .. } => Kind::Io,
        TransportError::Memory(_) => Kind::MemoryAccess,
        _ => Kind::Base,
    }
}

/// The error's message followed by its sources, so nothing the Rust side said is lost.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// An `InvalidArgumentError`.
pub(crate) fn invalid(message: impl Into<String>) -> PyErr {
    Kind::InvalidArgument.err(message)
}
