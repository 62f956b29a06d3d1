//! The fill views of memory the coordinator allocated (one region per entry), for
//! `kvbridge_testkit::fill`'s `fill_rows` / `verify_rows` and `fill_aux` / `verify_aux`.

use kvbridge_coordinator::AllocatedMemory;
use kvbridge_testkit::fill::{EntryView, entry_views};

/// Views of the KV entries.
pub fn kv_views(mem: &AllocatedMemory) -> Vec<EntryView> {
    entry_views(
        &mem.kv_regions,
        mem.memory.kv.iter().map(|e| (e.offset, e.len)),
    )
}

/// Views of the aux buffers.
pub fn aux_views(mem: &AllocatedMemory) -> Vec<EntryView> {
    entry_views(
        &mem.aux_regions,
        mem.memory.aux.iter().map(|e| (e.offset, e.len)),
    )
}
