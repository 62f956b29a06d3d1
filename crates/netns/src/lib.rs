//! Test support: a real network link between two Linux network namespaces, and kvbridge's
//! real processes on either end of it.
//!
//! [`Link::create`] makes two namespaces joined by a veth pair on the private test subnet
//! [`SUBNET`] (side A `10.213.1.1`, side B `10.213.1.2`), with the MTU asked for and an optional
//! `tbf` rate limit in each direction. [`Link`]'s destructor deletes both namespaces, which
//! deletes the veth pair with them; namespaces left by a harness process that died without
//! its destructors (killed, Ctrl-C) are deleted by the next [`Link::create`] (their names
//! carry the creating process's id). Faults: a silent partition ([`Link::partition`]:
//! `blackhole` routes on both sides, nothing closes), carrier loss ([`Link::carrier`]),
//! every process of one side stopped ([`Link::freeze`], `SIGSTOP`) and resumed.
//!
//! [`Proc::spawn`] runs a program inside one namespace (`ip netns exec`) in a process group of
//! its own, with its stdout lines delivered with their arrival time ([`Proc::next_line`]),
//! its stderr in a log file, and its stdin kept for commands ([`Proc::send`]); dropping a
//! [`Proc`] kills its group and reaps it. Every wait is bounded by the caller's deadline.
//!
//! Creating namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); [`unavailable`] says why
//! they cannot be made here, so callers skip with the reason.

pub mod demo;

use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The private subnet of every link (inside its own namespaces only, so links of concurrent
/// harnesses never meet).
pub const SUBNET: &str = "10.213.1.0/24";

/// Side A's address on the link.
pub const ADDR_A: Ipv4Addr = Ipv4Addr::new(10, 213, 1, 1);
/// Side B's address on the link.
pub const ADDR_B: Ipv4Addr = Ipv4Addr::new(10, 213, 1, 2);

/// Prefix of every namespace this crate creates (`kvbn<pid>n<k>a`, `...b`).
const PREFIX: &str = "kvbn";

/// Links made by this process (names must be unique).
static NEXT: AtomicU32 = AtomicU32::new(0);

/// Why network namespaces cannot be created here, or `None` when they can (checked by
/// creating and deleting one).
pub fn unavailable() -> Option<String> {
    if !cfg!(target_os = "linux") {
        return Some("network namespaces exist on Linux only".to_owned());
    }
    if !rustix::process::geteuid().is_root() {
        return Some(
            "creating network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN); run as \
             root"
                .to_owned(),
        );
    }
    let name = format!("{PREFIX}{}probe", std::process::id());
    match ip(&["netns", "add", &name]) {
        Ok(()) => {
            let _ = ip(&["netns", "del", &name]);
            None
        }
        Err(e) => Some(format!("`ip netns add` does not work here: {e}")),
    }
}

/// Runs `ip ARGS`, with its stderr as the error.
fn ip(args: &[&str]) -> Result<(), String> {
    run("ip", args)
}

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {program} (install iproute2): {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{program} {}` failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// What the link between the two namespaces is like.
#[derive(Debug, Clone, Copy)]
pub struct LinkOptions {
    /// MTU of both veth ends (1500 Ethernet, 9000 jumbo frames).
    pub mtu: u32,
    /// `tbf` rate limit of each direction in Mbit/s; `None`: the veth's own speed.
    pub rate_mbit: Option<u32>,
}

impl Default for LinkOptions {
    fn default() -> Self {
        Self {
            mtu: 1500,
            rate_mbit: None,
        }
    }
}

/// One end of a [`Link`].
#[derive(Debug, Clone)]
pub struct Side {
    /// The namespace's name (`ip netns exec NAME`).
    pub netns: String,
    /// The veth end inside it.
    pub veth: String,
    /// Its address on the link.
    pub addr: Ipv4Addr,
}

/// Two network namespaces joined by a veth pair; deleted on drop.
#[derive(Debug)]
pub struct Link {
    /// Side A (`10.213.1.1`).
    pub a: Side,
    /// Side B (`10.213.1.2`).
    pub b: Side,
    options: LinkOptions,
}

/// Deletes namespaces of this crate whose creating process is gone.
fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(PREFIX) else {
            continue;
        };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let alive = pid
            .parse::<u32>()
            .is_ok_and(|p| Path::new(&format!("/proc/{p}")).exists());
        if !pid.is_empty() && !alive {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

impl Link {
    /// Creates both namespaces, the veth pair between them (addresses, MTU, rate limit) and
    /// brings everything up. Fails with the command that failed; what was made is removed.
    pub fn create(options: LinkOptions) -> Result<Self, String> {
        remove_stale();
        let pid = std::process::id();
        let k = NEXT.fetch_add(1, Ordering::SeqCst);
        let side = |s: &str, addr| Side {
            netns: format!("{PREFIX}{pid}n{k}{s}"),
            // Interface names have at most 15 bytes.
            veth: format!("kv{pid}n{k}{s}"),
            addr,
        };
        let link = Link {
            a: side("a", ADDR_A),
            b: side("b", ADDR_B),
            options,
        };
        // From here on the destructor removes whatever was made.
        link.build()?;
        Ok(link)
    }

    fn build(&self) -> Result<(), String> {
        let (a, b) = (&self.a, &self.b);
        ip(&["netns", "add", &a.netns])?;
        ip(&["netns", "add", &b.netns])?;
        ip(&[
            "link", "add", &a.veth, "netns", &a.netns, "type", "veth", "peer", "name", &b.veth,
            "netns", &b.netns,
        ])?;
        let mtu = self.options.mtu.to_string();
        for s in [a, b] {
            let n = s.netns.as_str();
            ip(&["-n", n, "link", "set", "lo", "up"])?;
            ip(&["-n", n, "link", "set", &s.veth, "mtu", &mtu])?;
            ip(&[
                "-n",
                n,
                "addr",
                "add",
                &format!("{}/24", s.addr),
                "dev",
                &s.veth,
            ])?;
            ip(&["-n", n, "link", "set", &s.veth, "up"])?;
            if let Some(rate) = self.options.rate_mbit {
                // A burst of at least a few frames (and 4 ms at the rate) keeps tbf from
                // throttling below its rate.
                let burst = (u64::from(rate) * 1_000_000 / 8 / 250)
                    .max(4 * u64::from(self.options.mtu) + 4096);
                run(
                    "ip",
                    &[
                        "netns",
                        "exec",
                        n,
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        &s.veth,
                        "root",
                        "tbf",
                        "rate",
                        &format!("{rate}mbit"),
                        "burst",
                        &burst.to_string(),
                        "latency",
                        "50ms",
                    ],
                )?;
            }
        }
        Ok(())
    }

    /// The link's options.
    pub fn options(&self) -> LinkOptions {
        self.options
    }

    /// Starts (`on`) or ends a silent partition: `blackhole` routes to the other side's
    /// address on both sides. Nothing is closed and no packet is answered; connections stay
    /// open and go quiet.
    pub fn partition(&self, on: bool) -> Result<(), String> {
        let verb = if on { "add" } else { "del" };
        for (s, other) in [(&self.a, &self.b), (&self.b, &self.a)] {
            ip(&[
                "-n",
                &s.netns,
                "route",
                verb,
                "blackhole",
                &format!("{}/32", other.addr),
            ])?;
        }
        Ok(())
    }

    /// Takes side A's veth end down (`up`: back up): side B loses its carrier.
    pub fn carrier(&self, up: bool) -> Result<(), String> {
        let state = if up { "up" } else { "down" };
        ip(&["-n", &self.a.netns, "link", "set", &self.a.veth, state])
    }

    /// The ids of every process inside `side`'s namespace.
    pub fn pids(&self, side: &Side) -> Vec<i32> {
        Command::new("ip")
            .args(["netns", "pids", &side.netns])
            .output()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .split_whitespace()
                    .filter_map(|p| p.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Stops (`SIGSTOP`; `frozen == false`: resumes with `SIGCONT`) every process inside
    /// `side`'s namespace; returns how many.
    pub fn freeze(&self, side: &Side, frozen: bool) -> usize {
        let signal = if frozen {
            rustix::process::Signal::STOP
        } else {
            rustix::process::Signal::CONT
        };
        let pids = self.pids(side);
        for &p in &pids {
            if let Some(pid) = rustix::process::Pid::from_raw(p) {
                let _ = rustix::process::kill_process(pid, signal);
            }
        }
        pids.len()
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Processes still inside would keep a namespace alive without its name: end them
        // first (only those in these namespaces, which this harness started).
        for s in [&self.a, &self.b] {
            for p in self.pids(s) {
                if let Some(pid) = rustix::process::Pid::from_raw(p) {
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::CONT);
                    let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
                }
            }
        }
        for s in [&self.a, &self.b] {
            let _ = ip(&["netns", "del", &s.netns]);
        }
    }
}

/// A process running inside a namespace; killed (its whole group) and reaped on drop.
#[derive(Debug)]
pub struct Proc {
    /// A name for messages ("prefill", "decode 2").
    pub label: String,
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<(Instant, String)>,
    /// Where its stderr goes.
    pub log: PathBuf,
}

impl Proc {
    /// Runs `program ARGS` inside `netns` with `env` added, stderr into `log`.
    pub fn spawn(
        label: &str,
        netns: &str,
        program: &Path,
        args: &[String],
        env: &[(&str, &str)],
        log: &Path,
    ) -> Result<Self, String> {
        use std::os::unix::process::CommandExt;
        let err = std::fs::File::create(log)
            .map_err(|e| format!("cannot create the log {}: {e}", log.display()))?;
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", netns])
            .arg(program)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(err)
            .process_group(0);
        let mut child = command
            .spawn()
            .map_err(|e| format!("cannot start {label} ({}): {e}", program.display()))?;
        let stdout = child.stdout.take().ok_or("no stdout")?;
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { return };
                if tx.send((Instant::now(), line)).is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            label: label.to_owned(),
            stdin: child.stdin.take(),
            child,
            lines,
            log: log.to_path_buf(),
        })
    }

    /// The process id (`ip netns exec` replaces itself with the program).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Writes one line to its stdin.
    pub fn send(&mut self, line: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("stdin closed")?;
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .map_err(|e| format!("cannot write to {}: {e}", self.label))
    }

    /// Closes its stdin.
    pub fn close_stdin(&mut self) {
        self.stdin.take();
    }

    /// The next stdout line and when it arrived, or `None` at `deadline` or end of output.
    pub fn next_line(&self, deadline: Instant) -> Option<(Instant, String)> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.lines.recv_timeout(left).ok()
    }

    /// A stdout line that arrived already, if any.
    pub fn try_line(&self) -> Option<(Instant, String)> {
        self.lines.try_recv().ok()
    }

    /// Kills the process group (SIGKILL) and reaps it.
    pub fn kill(&mut self) {
        if let Some(pgid) = rustix::process::Pid::from_raw(self.child.id() as i32) {
            let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::CONT);
            let _ = rustix::process::kill_process_group(pgid, rustix::process::Signal::KILL);
        }
        let _ = self.child.wait();
    }

    /// Waits up to `limit` for it to exit; its exit code, or `None` (still running or killed
    /// by a signal).
    pub fn wait_exit(&mut self, limit: Duration) -> Option<i32> {
        let end = Instant::now() + limit;
        while Instant::now() < end {
            match self.child.try_wait() {
                Ok(Some(s)) => return s.code(),
                Ok(None) => std::thread::sleep(Duration::from_millis(20)),
                Err(_) => return None,
            }
        }
        None
    }

    /// The tail of its log, for failure messages.
    pub fn log_tail(&self, bytes: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let start = text.len().saturating_sub(bytes);
        let start = (start..text.len())
            .find(|&i| text.is_char_boundary(i))
            .unwrap_or(text.len());
        text[start..].to_owned()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}
