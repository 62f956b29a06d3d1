//! `allocate_shared` / `map_shared`: two mappings of one sealed memfd are the same bytes, and a
//! file that could shrink under a mapping is refused. Needs no NIXL runtime (no agent is made).
#![cfg(feature = "nixl")]

use kvbridge_nixl::{allocate_shared, map_shared, shared_fd};
use kvbridge_transport::MemoryRegion;

fn reopen(region: &MemoryRegion) -> std::fs::File {
    let fd = shared_fd(region).expect("a shared region has a file");
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(format!("/proc/self/fd/{fd}"))
        .expect("reopen the memfd")
}

#[test]
fn two_mappings_of_one_shared_region_are_the_same_bytes() {
    let a = allocate_shared(8192).unwrap();
    assert_eq!(a.len(), 8192);
    assert!(!a.can_borrow(), "shared memory is foreign, never borrowed");
    assert_eq!(a.to_vec(0, 8192).unwrap(), vec![0; 8192], "zeroed");
    let b = map_shared(reopen(&a), 8192).unwrap();
    assert_ne!(
        a.as_ptr(),
        b.as_ptr(),
        "a second mapping, at other addresses"
    );
    a.write_at(100, b"written through a").unwrap();
    assert_eq!(b.to_vec(100, 17).unwrap(), b"written through a");
    b.write_at(8000, b"and through b").unwrap();
    assert_eq!(a.to_vec(8000, 13).unwrap(), b"and through b");
    // A mapping of fewer bytes than the file is fine; more is refused.
    assert_eq!(map_shared(reopen(&a), 4096).unwrap().len(), 4096);
    let err = map_shared(reopen(&a), 8193).unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput);
    assert!(err.to_string().contains("8192 bytes"), "{err}");
    // Zero bytes: a valid, empty region.
    assert!(allocate_shared(0).unwrap().is_empty());
}

#[test]
fn files_that_could_shrink_are_refused() {
    // A tmpfs file (as /dev/shm holds) reports its seals, and has no shrink seal: refused by
    // the seal check. A file elsewhere cannot report seals: refused by the kernel's error.
    let shm = std::path::Path::new("/dev/shm");
    let dir = if shm.is_dir() {
        shm.to_path_buf()
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!("kvbridge-nixl-unsealed-{}", std::process::id()));
    let file = std::fs::File::create(&path).unwrap();
    file.set_len(4096).unwrap();
    let err = map_shared(file, 4096).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    if shm.is_dir() {
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidInput, "{err}");
        assert!(err.to_string().contains("F_SEAL_SHRINK"), "{err}");
    }
}

#[test]
fn only_shared_regions_have_a_file() {
    let owned = MemoryRegion::allocate(4096).unwrap();
    assert_eq!(shared_fd(&owned), None);
    assert!(shared_fd(&allocate_shared(16).unwrap()).is_some());
}
