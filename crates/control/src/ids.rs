//! Typed identifiers, so a room id is never passed where a generation is expected.
//!
//! Each is a `u64` on the wire (serde `transparent`: the JSON is the bare number, unchanged from
//! earlier releases) and `From<u64>`, so `agent.create_room(7)` still reads naturally.

use std::fmt;

use serde::{Deserialize, Serialize};

macro_rules! id_type {
    ($(#[$meta:meta])* $name:ident) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        #[derive(Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(pub u64);

        impl $name {
            /// The bare number (as SGLang and the wire carry it).
            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl From<u64> for $name {
            fn from(v: u64) -> Self {
                Self(v)
            }
        }

        impl From<$name> for u64 {
            fn from(v: $name) -> Self {
                v.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }
    };
}

id_type!(
    /// A request's bootstrap room (SGLang's `bootstrap_room`), chosen by the caller.
    RoomId
);
id_type!(
    /// One life of a room on one agent: a room cleared and created again gets a new one, so
    /// timers and drivers of the old life recognise themselves as stale.
    Incarnation
);
id_type!(
    /// A decode room's fencing generation: statuses and abort acks carry it, and only those of
    /// the current generation count.
    Generation
);
id_type!(
    /// One run of a decode agent (a new random value per start), so a prefill tells a restarted
    /// decode from the one it registered.
    SessionId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_bare_numbers_on_the_wire() {
        assert_eq!(serde_json::to_string(&RoomId(42)).unwrap(), "42");
        assert_eq!(
            serde_json::from_str::<Generation>("7").unwrap(),
            Generation(7)
        );
        assert_eq!(RoomId::from(3).get(), 3);
        assert_eq!(SessionId(9).to_string(), "9");
    }
}
