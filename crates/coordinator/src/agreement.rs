//! Cross-rank agreement on a room's state (SGLang's MIN all-reduce), as a pluggable hook.
//!
//! Every rank of a prefill DP shard (or decode attention group) polls its own room state; they
//! must agree before acting, so one failing rank fails everyone and nobody proceeds before the
//! slowest. The agents expose per-rank polls ([`PrefillAgent::poll`](crate::PrefillAgent::poll))
//! and an agreed poll through a [`RankAgreement`] (`poll_agreed`). Plug in your collective
//! (e.g. a MIN all-reduce over the ranks' process group); [`LocalOnly`] and [`SharedMin`] are
//! provided.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kvbridge_transport::sync::lock;

use crate::state::RoomState;

/// Combines this rank's view of a room with the other ranks' views.
#[async_trait::async_trait]
pub trait RankAgreement: Send + Sync + 'static {
    /// The agreed state of `room` given this rank's `local` state (usually the MIN over ranks).
    async fn agree(&self, room: u64, local: RoomState) -> RoomState;

    /// This rank no longer holds `room` (cleared).
    fn forget(&self, room: u64) {
        let _ = room;
    }
}

/// No agreement: a single rank's state is the agreed state.
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalOnly;

#[async_trait::async_trait]
impl RankAgreement for LocalOnly {
    async fn agree(&self, _room: u64, local: RoomState) -> RoomState {
        local
    }
}

#[derive(Debug)]
struct Board {
    size: usize,
    rooms: HashMap<u64, Vec<Option<RoomState>>>,
    cleared: HashMap<u64, usize>,
}

/// An in-process MIN over a fixed group of ranks: each member publishes its latest state and
/// reads the minimum over all members (a member that has not published yet counts as
/// Bootstrapping). Create the group once and give each rank its [`SharedMin::member`].
#[derive(Debug, Clone)]
pub struct SharedMin {
    board: Arc<Mutex<Board>>,
    member: usize,
}

impl SharedMin {
    /// A group of `size` ranks; returns one handle per rank.
    pub fn group(size: usize) -> Vec<SharedMin> {
        let size = size.max(1);
        let board = Arc::new(Mutex::new(Board {
            size,
            rooms: HashMap::new(),
            cleared: HashMap::new(),
        }));
        (0..size)
            .map(|member| SharedMin {
                board: board.clone(),
                member,
            })
            .collect()
    }

    /// This handle's rank in the group.
    pub fn member(&self) -> usize {
        self.member
    }

    /// Runs `f` on the board under its lock (the only place that takes it).
    fn with_board<R>(&self, f: impl FnOnce(&mut Board) -> R) -> R {
        f(&mut lock(&self.board))
    }
}

#[async_trait::async_trait]
impl RankAgreement for SharedMin {
    async fn agree(&self, room: u64, local: RoomState) -> RoomState {
        let member = self.member;
        self.with_board(|b| {
            let size = b.size;
            let slots = b.rooms.entry(room).or_insert_with(|| vec![None; size]);
            slots[member] = Some(local);
            slots
                .iter()
                .map(|s| s.unwrap_or(RoomState::Bootstrapping))
                .min()
                .unwrap_or(local)
        })
    }

    fn forget(&self, room: u64) {
        self.with_board(|b| {
            let size = b.size;
            let n = b.cleared.entry(room).or_default();
            *n += 1;
            if *n >= size {
                b.cleared.remove(&room);
                b.rooms.remove(&room);
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn shared_min_waits_for_the_slowest_and_fails_everyone() {
        let g = SharedMin::group(2);
        assert_eq!(
            g[0].agree(1, RoomState::Success).await,
            RoomState::Bootstrapping
        );
        assert_eq!(
            g[1].agree(1, RoomState::Transferring).await,
            RoomState::Transferring
        );
        assert_eq!(g[1].agree(1, RoomState::Success).await, RoomState::Success);
        assert_eq!(g[0].agree(2, RoomState::Failed).await, RoomState::Failed);
        assert_eq!(g[1].agree(2, RoomState::Success).await, RoomState::Failed);
        g[0].forget(2);
        g[1].forget(2);
        assert_eq!(
            g[1].agree(2, RoomState::Success).await,
            RoomState::Bootstrapping
        );
    }
}
