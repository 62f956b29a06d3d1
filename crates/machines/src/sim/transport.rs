//! The simulated transport: connections from prefill processes to decode processes, and
//! batches that land after a random time, fail, lose their peer, or hang until cancelled. A
//! cancel makes its batch final after a delay (a batch done before then still lands), or
//! never returns, or fails. A process that restarts takes its batches with it.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use kvbridge_transport::{BatchId, PeerId};

use super::checks::Invariant;
use super::driver::Waited;
use super::prefill_node::SimConn;
use super::schedule::{BATCH_TIMEOUT, FENCE_GRACE, PAGE_TOKENS};
use super::world::{Ev, PrefillLifeId, World};
use kvbridge_control::Generation;
use kvbridge_control::TransferInfo;

/// Why a post was refused (nothing of it moves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PostError {
    Lost,
    Unknown,
}

impl PostError {
    pub(super) fn is_lost(self) -> bool {
        self == PostError::Lost
    }
}

impl fmt::Display for PostError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            PostError::Lost => "the peer was lost",
            PostError::Unknown => "the peer is not connected",
        })
    }
}

/// What a batch writes: KV rows of tokens `first..first + tokens`, or the aux row.
#[derive(Debug, Clone, Copy)]
pub(super) enum Payload {
    Kv { first: u64, tokens: u64 },
    Aux,
}

/// How a batch ends, and when.
#[derive(Debug, Clone, Copy)]
enum Fate {
    Done(Duration),
    Error(Duration),
    Lost(Duration),
    Hang,
}

impl Fate {
    fn at(self) -> Option<Duration> {
        match self {
            Fate::Done(t) | Fate::Error(t) | Fate::Lost(t) => Some(t),
            Fate::Hang => None,
        }
    }
}

#[derive(Debug)]
pub(super) struct Batch {
    pub(super) id: BatchId,
    owner: PrefillLifeId,
    /// The decode rank the driver indexes it by, and whether it carries the aux row.
    sender: (usize, bool),
    conn: PeerId,
    /// The decode index and process epoch it writes to.
    pub(super) decode: (usize, u32),
    generation: Generation,
    payload: Payload,
    /// The decode pages (or aux row) it writes.
    slots: Vec<u64>,
    bytes: u64,
    fate: Fate,
    /// Bumped when the fate changes: earlier `BatchFinal` events are stale.
    version: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnState {
    Open,
    Lost,
    Closed,
}

#[derive(Debug)]
struct Conn {
    prefill: (usize, u32),
    decode: (usize, u32),
    state: ConnState,
}

#[derive(Debug, Default)]
pub(super) struct Transport {
    next_peer: u64,
    next_batch: u64,
    conns: BTreeMap<PeerId, Conn>,
    /// Batches not final yet.
    batches: BTreeMap<BatchId, Batch>,
}

impl Batch {
    pub(super) fn owner(&self) -> PrefillLifeId {
        self.owner
    }
}

impl Transport {
    pub(super) fn open(&mut self, prefill: (usize, u32), decode: (usize, u32)) -> PeerId {
        self.next_peer += 1;
        let peer = PeerId(self.next_peer);
        let state = ConnState::Open;
        self.conns.insert(
            peer,
            Conn {
                prefill,
                decode,
                state,
            },
        );
        peer
    }

    /// A batch of prefill `p`'s process `epoch` for `room` that may still land.
    pub(super) fn in_flight_from(
        &self,
        p: usize,
        epoch: u32,
        room: kvbridge_control::RoomId,
    ) -> Option<&Batch> {
        self.batches
            .values()
            .find(|b| b.owner.p == p && b.owner.epoch == epoch && b.owner.room == room)
    }

    /// A batch to decode room life `(d, epoch, generation)` that may still land.
    pub(super) fn in_flight_to(&self, life: (usize, u32, Generation)) -> Option<&Batch> {
        self.batches
            .values()
            .find(|b| (b.decode.0, b.decode.1, b.generation) == life)
    }
}

impl World {
    /// Posts a batch on `conn` for the room life `owner`, to the decode room of `info`.
    pub(super) fn transport_post(
        &mut self,
        owner: PrefillLifeId,
        pi: usize,
        conn: &SimConn,
        info: &TransferInfo,
        payload: Payload,
    ) -> Result<BatchId, PostError> {
        match self.transport.conns.get(&conn.peer).map(|c| c.state) {
            None | Some(ConnState::Closed) => return Err(PostError::Unknown),
            Some(ConnState::Lost) => return Err(PostError::Lost),
            Some(ConnState::Open) => {}
        }
        let fate = self.draw_fate();
        let (slots, bytes) = match payload {
            Payload::Kv { first, tokens } => {
                let base = info.decode_prefix_len / PAGE_TOKENS;
                let pages = first / PAGE_TOKENS..=(first + tokens - 1) / PAGE_TOKENS;
                let slots = pages
                    .filter_map(|i| info.dst_pages.get(i.checked_sub(base)? as usize).copied())
                    .collect();
                (slots, tokens * 64)
            }
            Payload::Aux => (info.dst_aux_index.into_iter().collect(), 32),
        };
        self.transport.next_batch += 1;
        let id = BatchId(self.transport.next_batch);
        let batch = Batch {
            id,
            owner,
            sender: (pi, matches!(payload, Payload::Aux)),
            conn: conn.peer,
            decode: (conn.decode, conn.decode_epoch),
            generation: info.generation,
            payload,
            slots,
            bytes,
            fate,
            version: 0,
        };
        self.transport.batches.insert(id, batch);
        self.stats.batches_posted += 1;
        self.note(|| {
            format!(
                "  prefill-{} posts batch {id} {payload:?} of room {} to decode-{} ({fate:?})",
                owner.p, owner.room, conn.decode
            )
        });
        if let Some(at) = fate.at() {
            self.schedule_at(
                at,
                Ev::BatchFinal {
                    batch: id,
                    version: 0,
                },
            );
        }
        self.schedule(BATCH_TIMEOUT + FENCE_GRACE, Ev::WaiterGivesUp { batch: id });
        Ok(id)
    }

    fn draw_fate(&mut self) -> Fate {
        let k = &self.knobs;
        let (hang, error, lost, slow, ms) = (
            k.p_batch_hangs,
            k.p_batch_error,
            k.p_batch_lost,
            k.p_batch_slow,
            k.batch_ms,
        );
        let took = self.now + self.rng.millis(1, ms);
        if self.rng.chance(hang) {
            Fate::Hang
        } else if self.rng.chance(error) {
            Fate::Error(took)
        } else if self.rng.chance(lost) {
            Fate::Lost(took)
        } else if self.rng.chance(slow) {
            // Past its deadline: the transport fails it (TimedOut).
            Fate::Error(self.now + BATCH_TIMEOUT)
        } else {
            Fate::Done(took)
        }
    }

    pub(super) fn batch_final(&mut self, id: BatchId, version: u32) {
        if self
            .transport
            .batches
            .get(&id)
            .is_none_or(|b| b.version != version)
        {
            return;
        }
        let Some(b) = self.transport.batches.remove(&id) else {
            return;
        };
        let waited = match b.fate {
            Fate::Done(_) => {
                if self.sabotage.done_without_bytes && self.rng.chance(0.3) {
                    self.note(|| format!("  batch {id} reported done, its bytes never landed"));
                } else {
                    self.land(&b);
                }
                Waited::Done { bytes: b.bytes }
            }
            Fate::Lost(_) => {
                self.stats.batches_failed += 1;
                self.lose_conn(b.conn);
                Waited::Failed {
                    lost: true,
                    peer: b.conn,
                }
            }
            Fate::Error(_) | Fate::Hang => {
                self.stats.batches_failed += 1;
                Waited::Failed {
                    lost: false,
                    peer: b.conn,
                }
            }
        };
        self.note(|| format!("  batch {id} final: {waited:?}"));
        self.batch_waited(b.owner, id, b.sender, waited);
    }

    /// The bytes of `b` land: on pages its decode room life still owns, or the fence broke.
    fn land(&mut self, b: &Batch) {
        let (d, epoch) = b.decode;
        let n = &self.decodes[d];
        if n.epoch != epoch {
            return;
        }
        let life = n.generations.get(&b.generation).copied();
        let aux = matches!(b.payload, Payload::Aux);
        let pool = if aux { &n.aux_rows } else { &n.pages };
        let wrong: Vec<(u64, Option<u64>)> = b
            .slots
            .iter()
            .map(|&s| (s, pool.owner(s)))
            .filter(|&(_, o)| life.is_none() || o != life)
            .collect();
        if !wrong.is_empty() {
            let what = format!(
                "batch {} of prefill-{} room {} (generation {}) landed on {} {wrong:?} (slot, \
                 owning life) of decode-{d}, released by the room life it was posted for",
                b.id,
                b.owner.p,
                b.owner.room,
                b.generation,
                if aux { "aux rows" } else { "pages" },
            );
            self.violate(Invariant::FenceHolds, what);
        }
        let key = (d, epoch, b.generation);
        match b.payload {
            Payload::Kv { first, tokens } => {
                self.oracle
                    .landed_tokens(key, b.owner.p, first, first + tokens)
            }
            Payload::Aux => self.oracle.landed_aux(key, b.owner.p),
        }
    }

    pub(super) fn waiter_gives_up(&mut self, id: BatchId) {
        let Some(b) = self.transport.batches.get(&id) else {
            return;
        };
        let (owner, sender) = (b.owner, b.sender);
        self.batch_waited(owner, id, sender, Waited::Hung);
    }

    /// Cancels a batch: it is final after a delay (unless done before), or the cancel hangs
    /// or fails; a cancel of a final batch returns at once.
    pub(super) fn cancel(&mut self, owner: PrefillLifeId, id: BatchId) {
        self.stats.cancels += 1;
        let returned = |ok| Ev::CancelReturned {
            owner,
            batch: id,
            ok,
        };
        if !self.transport.batches.contains_key(&id) || self.sabotage.cancel_lies {
            return self.schedule(Duration::ZERO, returned(true));
        }
        let (hangs, fails) = (self.knobs.p_cancel_hangs, self.knobs.p_cancel_fails);
        if self.rng.chance(hangs) {
            return;
        }
        let delay = self.rng.millis(0, 50);
        if self.rng.chance(fails) {
            return self.schedule(delay, returned(false));
        }
        let final_at = self.now + delay;
        let Some(b) = self.transport.batches.get_mut(&id) else {
            return;
        };
        if b.fate.at().is_none_or(|t| t > final_at) {
            b.fate = Fate::Error(final_at);
            b.version += 1;
            let version = b.version;
            self.schedule_at(final_at, Ev::BatchFinal { batch: id, version });
        }
        self.schedule_at(final_at, returned(true));
    }

    /// Fails every batch that matches `pick` now (`lost`: with the peer lost).
    fn end_batches(&mut self, pick: impl Fn(&Batch) -> bool, lost: bool) {
        let now = self.now;
        let mut due = Vec::new();
        for b in self.transport.batches.values_mut().filter(|b| pick(b)) {
            b.fate = if lost {
                Fate::Lost(now)
            } else {
                Fate::Error(now)
            };
            b.version += 1;
            due.push((b.id, b.version));
        }
        for (batch, version) in due {
            self.schedule_at(now, Ev::BatchFinal { batch, version });
        }
    }

    /// A batch found the connection lost: every batch on it fails, nothing is posted on it.
    fn lose_conn(&mut self, peer: PeerId) {
        if let Some(c) = self.transport.conns.get_mut(&peer) {
            if c.state == ConnState::Open {
                c.state = ConnState::Lost;
            }
        }
        self.end_batches(|b| b.conn == peer, true);
    }

    /// The machine closes a connection nothing uses any more.
    pub(super) fn disconnect(&mut self, peer: PeerId) {
        if let Some(c) = self.transport.conns.get_mut(&peer) {
            c.state = ConnState::Closed;
        }
        self.end_batches(|b| b.conn == peer, false);
    }

    /// A prefill process is gone: its connections and batches with it.
    pub(super) fn prefill_process_gone(&mut self, p: usize, epoch: u32) {
        for c in self.transport.conns.values_mut() {
            if c.prefill == (p, epoch) {
                c.state = ConnState::Closed;
            }
        }
        self.end_batches(|b| b.owner.p == p && b.owner.epoch == epoch, false);
    }

    /// A decode process is gone: connections to it are lost, batches to it fail.
    pub(super) fn decode_process_gone(&mut self, d: usize, epoch: u32) {
        for c in self.transport.conns.values_mut() {
            if c.decode == (d, epoch) && c.state == ConnState::Open {
                c.state = ConnState::Lost;
            }
        }
        self.end_batches(|b| b.decode == (d, epoch), true);
    }
}
