//! Faults on a real link: the demo's prefill (with the bootstrap server) in one network
//! namespace, its decode ranks in another, joined by a veth pair (MTU 1500, 400 Mbit/s `tbf`),
//! every process the `kvbridge` binary's own roles (`demo --role ... --serve`), bound to and
//! advertising its namespace's address. Each test injects one fault while rooms are
//! transferring and checks that every room in flight ends by its deadline with a cause naming
//! the peer, that no byte lands in a failed room's pages after its fence (a canary the decode
//! writes there and checks before reusing them), that no room is left, and that new requests
//! succeed after the fault without restarting any process (the decode, after a prefill
//! restart at the same address).
//!
//! Needs root (`ip netns`); elsewhere each test prints why it skips and passes. The tests run
//! one at a time (timings must not share the CPU). Each prints its row of the fault table
//! (docs/TESTING.md, "Network faults"): `cargo test -p kvbridge-lab --test netns --
//! --nocapture`.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kvbridge_netns::demo::{DemoSpec, Deployment};
use kvbridge_netns::{Link, LinkOptions};

/// One test at a time.
static SERIAL: Mutex<()> = Mutex::new(());

/// The requests' deadline (`--timeout`): the transport's keep-alive timeout is half of it
/// (3 s), the decode's heartbeat a tenth (0.6 s, lost after 2 missed).
const TIMEOUT_S: f64 = 6.0;
const BOOTSTRAP_PORT: u16 = 18998;
const DECODE_RANKS: u32 = 2;
const SECRET: &str = "netns fault tests";

/// Every process's demo arguments: MLA, 8 layers, 4096 tokens (37.7 MB per request), prefill
/// DCP 1 -> decode DCP 2, 4 chunks 300 ms apart, 2 requests at once.
fn demo_args(timeout_s: f64) -> Vec<String> {
    [
        "demo",
        "--transport",
        "tcp",
        "--layers",
        "8",
        "--tokens",
        "4096",
        "--chunk-tokens",
        "1024",
        "--chunk-delay-ms",
        "300",
        "--dcp",
        &DECODE_RANKS.to_string(),
        "--concurrency",
        "2",
        "--timeout",
        &timeout_s.to_string(),
    ]
    .map(str::to_owned)
    .to_vec()
}

fn start(name: &str) -> Deployment {
    start_with(name, TIMEOUT_S)
}

fn start_with(name: &str, timeout_s: f64) -> Deployment {
    let spec = DemoSpec {
        exe: PathBuf::from(env!("CARGO_BIN_EXE_kvbridge-lab")),
        args: demo_args(timeout_s),
        decode_ranks: DECODE_RANKS,
        bootstrap_port: BOOTSTRAP_PORT,
        secret: SECRET.to_owned(),
        // Warnings in the logs: why a connection closed, which deadline fired.
        env: vec![("RUST_LOG".to_owned(), "warn".to_owned())],
    };
    let link = LinkOptions {
        mtu: 1500,
        rate_mbit: Some(400),
    };
    Deployment::start(name, link, spec).unwrap_or_else(|e| panic!("{e}"))
}

/// Skips (with the reason printed) where namespaces cannot be made; holds the serial lock.
fn guard() -> Option<std::sync::MutexGuard<'static, ()>> {
    let lock = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(why) = kvbridge_netns::unavailable() {
        eprintln!("skipped: {why}");
        return None;
    }
    Some(lock)
}

/// Asserts that every process ended every request of `range` with a failure within `limit`
/// of `t0`, each cause naming the peer it lost (its address on the link) or saying it
/// follows from another failure.
fn assert_failed_naming_peer(
    d: &Deployment,
    range: std::ops::Range<u32>,
    t0: Instant,
    limit: Duration,
) {
    for r in range {
        for (i, p) in d.procs.iter().enumerate() {
            let e = &d.ends[&(i, r)];
            assert!(!e.ok, "{} request {r} succeeded across the fault", p.label);
            let after = e.at.saturating_duration_since(t0);
            assert!(
                after <= limit,
                "{} request {r} ended {after:?} after the fault, past its deadline {limit:?}: {}",
                p.label,
                e.reason
            );
            let peer = if i == 0 { d.link.b.addr } else { d.link.a.addr };
            assert!(
                e.reason.contains(&peer.to_string()) || e.reason.contains("aborted"),
                "{} request {r}: the cause names neither the peer {peer} nor an abort: {}",
                p.label,
                e.reason
            );
        }
    }
}

/// The longest a room in flight may take to end after a fault: its deadline plus the
/// scheduling slack of a loaded 2-core machine.
fn deadline() -> Duration {
    Duration::from_secs_f64(TIMEOUT_S + 3.0)
}

/// A fault held until every room in flight ended, then lifted (`fault(link, true)` starts it):
/// each room ends by its deadline with a cause naming the peer, no byte lands after the fence
/// (a canary per failed room and decode rank), and new requests succeed without a restart.
/// `row` names the fault in the table from how long it lasted (s).
fn fault_ends_every_room_and_heals(
    name: &str,
    fault: impl Fn(&Link, bool) -> Result<(), String>,
    row: impl Fn(f64) -> String,
    lifted: &str,
) {
    let Some(_serial) = guard() else { return };
    let mut d = start(name);
    d.run(0..2).unwrap();
    d.wait_transferring(0);
    fault(&d.link, true).unwrap();
    let t0 = Instant::now();
    // Every room in flight ends while the fault lasts.
    d.wait_ended(0..2, deadline());
    assert_failed_naming_peer(&d, 0..2, t0, deadline());
    fault(&d.link, false).unwrap();
    let healed = Instant::now();
    // Anything still in flight on the old connections lands now, if it ever does.
    std::thread::sleep(Duration::from_secs(1));
    // The decode ranks' pool slots come back once each failed room's fence ends.
    assert!(d.wait_released(0..2, Duration::from_secs(30)));
    d.run(2..4).unwrap();
    d.wait_ended(2..4, Duration::from_secs(30));
    d.assert_succeeded(2..4);
    let recovery = format!(
        "requests 2-3 succeeded {:.1} s after {lifted}, no restart",
        d.ends[&(0, 3)]
            .at
            .saturating_duration_since(healed)
            .as_secs_f64()
    );
    let lasted = healed.duration_since(t0).as_secs_f64();
    println!("{}", d.table_row(&row(lasted), 0..2, t0, &recovery));
    let canaries = d.assert_canaries();
    assert_eq!(
        canaries,
        DECODE_RANKS as usize * 2,
        "a canary per failed room and decode rank"
    );
    d.finish();
}

#[test]
fn a_partition_longer_than_the_deadline_ends_every_room_and_heals() {
    fault_ends_every_room_and_heals(
        "partition",
        |link, on| link.partition(on),
        |s| format!("blackhole {s:.1} s (healed once every room ended)"),
        "the heal",
    );
}

#[test]
fn carrier_loss_ends_every_room_and_heals() {
    fault_ends_every_room_and_heals(
        "carrier",
        |link, on| link.carrier(!on),
        |s| format!("carrier down {s:.1} s (up once every room ended)"),
        "the carrier returned",
    );
}

/// A partition fails no room while it stays shorter than the decode's heartbeat window
/// (`heartbeat_max_failures` consecutive intervals: 2 x 2 s with `--timeout 20`) and the
/// transport's keep-alive (10 s): the transfer stalls and resumes. (A lost segment is resent
/// with TCP's backed-off timer, so a partition delays what it caught by up to about its own
/// length again: the margin docs/TESTING.md states.)
#[test]
fn a_partition_shorter_than_the_heartbeat_window_fails_no_room() {
    let Some(_serial) = guard() else { return };
    let mut d = start_with("short", 20.0);
    d.run(0..2).unwrap();
    d.wait_transferring(0);
    d.link.partition(true).unwrap();
    let t0 = Instant::now();
    std::thread::sleep(Duration::from_millis(1500));
    d.link.partition(false).unwrap();
    d.wait_ended(0..2, Duration::from_secs(40));
    println!(
        "{}",
        d.table_row(
            "blackhole 1.5 s (heartbeat 2 s x 2, keep-alive 10 s)",
            0..2,
            t0,
            "nothing failed"
        )
    );
    d.assert_succeeded(0..2);
    d.finish();
}

#[test]
fn frozen_decodes_end_the_prefills_rooms_and_recover() {
    let Some(_serial) = guard() else { return };
    let mut d = start("freeze");
    d.run(0..2).unwrap();
    d.wait_transferring(0);
    let b = d.link.b.clone();
    assert_eq!(
        d.link.freeze(&b, true),
        DECODE_RANKS as usize,
        "every decode process stopped"
    );
    let t0 = Instant::now();
    // The prefill's rooms end by their deadline while the decodes cannot answer.
    assert!(
        d.until(deadline(), |d| (0..2).all(|r| d.ends.contains_key(&(0, r)))),
        "the prefill's rooms did not end within {:?} of the freeze; log:\n{}",
        deadline(),
        d.procs[0].log_tail(4000)
    );
    d.link.freeze(&b, false);
    let resumed = Instant::now();
    // The decodes' own deadlines passed while they were stopped: their rooms end at once.
    d.wait_ended(0..2, deadline());
    for r in 0..2 {
        assert!(
            !d.ends[&(0, r)].ok,
            "the prefill's request {r} succeeded while the decodes were stopped"
        );
    }
    std::thread::sleep(Duration::from_secs(1));
    // The decode ranks' pool slots come back once each failed room's fence ends.
    assert!(d.wait_released(0..2, Duration::from_secs(30)));
    d.run(2..4).unwrap();
    d.wait_ended(2..4, Duration::from_secs(30));
    d.assert_succeeded(2..4);
    d.assert_canaries();
    let recovery = format!(
        "decode rooms ended {:.1} s after SIGCONT; requests 2-3 succeeded, no restart",
        (0..2)
            .flat_map(|r| (1..d.procs.len()).map(move |i| (i, r)))
            .map(|k| d.ends[&k]
                .at
                .saturating_duration_since(resumed)
                .as_secs_f64())
            .fold(0.0, f64::max)
    );
    println!(
        "{}",
        d.table_row(
            &format!(
                "decode namespace SIGSTOP {:.1} s (SIGCONT once the prefill's rooms ended)",
                resumed.duration_since(t0).as_secs_f64()
            ),
            0..2,
            t0,
            &recovery
        )
    );
    d.finish();
}

#[test]
fn a_prefill_restarted_at_the_same_address_serves_the_same_decodes() {
    let Some(_serial) = guard() else { return };
    let mut d = start("restart");
    d.run(0..2).unwrap();
    d.wait_transferring(0);
    d.procs[0].kill();
    let t0 = Instant::now();
    // The killed prefill reports nothing; the decodes end their rooms by their deadline.
    let decodes_ended = d.until(deadline(), |d| {
        (0..2).all(|r| (1..d.procs.len()).all(|i| d.ends.contains_key(&(i, r))))
    });
    assert!(
        decodes_ended,
        "the decodes' rooms did not end within {:?} of the prefill's death; logs in {}",
        deadline(),
        d.logs.display()
    );
    for r in 0..2 {
        for i in 1..d.procs.len() {
            let e = &d.ends[&(i, r)];
            assert!(!e.ok);
            let peer = d.link.a.addr.to_string();
            assert!(
                e.reason.contains(&peer) || e.reason.contains("aborted"),
                "{} request {r}: {}",
                d.procs[i].label,
                e.reason
            );
        }
    }
    let prefill = d.spawn_prefill().unwrap();
    d.procs[0] = prefill;
    d.wait_ready(0).unwrap();
    let restarted = Instant::now();
    // The decode ranks' pool slots come back once each failed room's fence ends.
    assert!(d.wait_released(0..2, Duration::from_secs(30)));
    d.run(2..4).unwrap();
    d.wait_ended(2..4, Duration::from_secs(30));
    d.assert_succeeded(2..4);
    d.assert_canaries();
    let recovery = format!(
        "prefill restarted at {}; requests 2-3 succeeded {:.1} s later, decodes not restarted",
        d.bootstrap(),
        d.ends[&(0, 3)]
            .at
            .saturating_duration_since(restarted)
            .as_secs_f64()
    );
    println!(
        "{}",
        d.table_row("prefill SIGKILL + restart", 0..2, t0, &recovery)
    );
    d.finish();
}
