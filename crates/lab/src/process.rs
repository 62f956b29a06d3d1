//! The lab's process orchestrator: `kvbridge-lab demo` and `kvbridge-lab bench` start their
//! other processes here, as this binary run again with role arguments.
//!
//! A [`Worker`] is one such process: its stdin is a command pipe (closing it tells the worker its
//! parent is gone), each line of its stdout reaches the run's channel tagged with the worker's
//! index ([`Output`]), its stderr is the parent's. [`Worker::reap`] ends it within a bound (a
//! kill after the grace) and removes the shared-memory control directories it reported, when it
//! could not remove them itself.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdin};
use tokio::sync::mpsc;

/// A command that runs this binary again, inside network namespace `netns` when given (through
/// `ip netns exec`, which needs root).
///
/// # Errors
/// When the path of this binary cannot be found.
pub fn this_binary(netns: Option<&str>) -> Result<std::process::Command, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this binary: {e}"))?;
    Ok(match netns {
        Some(ns) => {
            let mut c = std::process::Command::new("ip");
            c.args(["netns", "exec", ns]).arg(exe);
            c
        }
        None => std::process::Command::new(exe),
    })
}

/// What a worker's stdout said, tagged with the worker's index in its run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// One line (without its newline).
    Line(usize, String),
    /// Its stdout closed: it exited, or is about to.
    Eof(usize),
}

/// What dropping a [`Worker`] without reaping it does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OnDrop {
    /// Kill it (SIGKILL): a run that ends early leaves nothing running.
    Kill,
    /// Only close its stdin: it cleans up after itself and exits.
    CloseStdin,
}

/// How a worker ended.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Ended {
    /// Its exit code, when it exited.
    pub code: Option<i32>,
    /// The signal that ended it, when one did (9 when [`Worker::reap`] killed it).
    pub signal: Option<i32>,
}

/// One process of a run.
#[derive(Debug)]
pub struct Worker {
    label: String,
    child: Child,
    stdin: Option<ChildStdin>,
    pid: Option<u32>,
    /// Shared-memory control directories it created (it reports them): removed by
    /// [`reap`](Self::reap) when it could not remove them itself.
    pub control_dirs: Vec<PathBuf>,
}

impl Worker {
    /// Starts `command` as worker `index` of a run whose stdout lines go to `output`.
    ///
    /// # Errors
    /// When the process cannot be started; the message names `label`.
    pub fn start(
        label: impl Into<String>,
        command: std::process::Command,
        index: usize,
        output: &mpsc::Sender<Output>,
        on_drop: OnDrop,
    ) -> Result<Self, String> {
        let label = label.into();
        let mut child = tokio::process::Command::from(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .kill_on_drop(on_drop == OnDrop::Kill)
            .spawn()
            .map_err(|e| format!("cannot start the {label} process: {e}"))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| format!("the {label} process has no stdout"))?;
        let output = output.clone();
        tokio::spawn(async move {
            let mut lines = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                if output.send(Output::Line(index, line)).await.is_err() {
                    return;
                }
            }
            let _ = output.send(Output::Eof(index)).await;
        });
        Ok(Self {
            pid: child.id(),
            stdin: child.stdin.take(),
            child,
            label,
            control_dirs: Vec::new(),
        })
    }

    /// Its name in messages ("decode 2", "receiver").
    pub fn label(&self) -> &str {
        &self.label
    }

    /// Its process id (`None` once it has been waited for).
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    /// Sends it one command line.
    ///
    /// # Errors
    /// When its stdin is closed or the write fails (it exited).
    pub async fn send(&mut self, line: &str) -> Result<(), String> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| format!("the {} process's stdin is closed", self.label))?;
        stdin
            .write_all(format!("{line}\n").as_bytes())
            .await
            .map_err(|e| format!("writing to the {} process: {e}", self.label))
    }

    /// Closes its stdin: it reads end of file, which tells it its parent is gone.
    pub fn close_stdin(&mut self) {
        self.stdin = None;
    }

    /// Kills it (SIGKILL) without waiting.
    pub fn kill(&mut self) {
        let _ = self.child.start_kill();
    }

    /// Waits up to `grace` for it to exit, then kills it and waits for that. Removes its
    /// control directories unless `reported` (it said it finished, so it removed them itself).
    pub async fn reap(&mut self, grace: Duration, reported: bool) -> Ended {
        let status = match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(Ok(status)) => Some(status),
            _ => {
                self.kill();
                self.child.wait().await.ok()
            }
        };
        if !reported {
            for dir in &self.control_dirs {
                remove_control_dir(dir);
            }
        }
        Ended {
            code: status.and_then(|s| s.code()),
            signal: status.and_then(|s| std::os::unix::process::ExitStatusExt::signal(&s)),
        }
    }
}

/// Removes a shared-memory control directory of a process that could not (it died): its
/// socket, then the (then empty) directory. Anything else in it is left alone.
pub fn remove_control_dir(dir: &Path) {
    let _ = std::fs::remove_file(dir.join("ctl.sock"));
    let _ = std::fs::remove_dir(dir);
}

/// Resolves on the first SIGINT, SIGTERM or SIGHUP, with its name (never, when they cannot be
/// watched). Processes that own shared memory stop on it through their destructors instead of
/// dying with their control directories left behind.
pub async fn terminating_signal() -> &'static str {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut int), Ok(mut term), Ok(mut hup)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
        signal(SignalKind::hangup()),
    ) else {
        tracing::warn!("cannot watch for signals; a signal ends this process without cleanup");
        return std::future::pending().await;
    };
    tokio::select! {
        _ = int.recv() => "interrupted (SIGINT)",
        _ = term.recv() => "terminated (SIGTERM)",
        _ = hup.recv() => "hung up (SIGHUP)",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell(script: &str) -> std::process::Command {
        let mut c = std::process::Command::new("sh");
        c.args(["-c", script]);
        c
    }

    #[tokio::test]
    async fn a_worker_s_lines_reach_the_run_tagged_and_its_commands_reach_it() {
        let (tx, mut rx) = mpsc::channel(8);
        let mut w = Worker::start("echo", shell("read l; echo got $l"), 3, &tx, OnDrop::Kill)
            .expect("start sh");
        w.send("hello").await.unwrap();
        assert_eq!(
            rx.recv().await,
            Some(Output::Line(3, "got hello".to_owned()))
        );
        assert_eq!(rx.recv().await, Some(Output::Eof(3)));
        let ended = w.reap(Duration::from_secs(10), true).await;
        assert_eq!(
            ended,
            Ended {
                code: Some(0),
                signal: None
            }
        );
    }

    #[tokio::test]
    async fn reap_kills_a_worker_past_its_grace_and_removes_what_it_reported() {
        let dir = std::env::temp_dir().join(format!("kvbridge-lab-reap-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ctl.sock"), b"").unwrap();
        let (tx, _rx) = mpsc::channel(8);
        let mut w = Worker::start("sleeper", shell("exec sleep 60"), 0, &tx, OnDrop::Kill)
            .expect("start sh");
        w.control_dirs.push(dir.clone());
        let ended = w.reap(Duration::from_millis(100), false).await;
        assert_eq!(ended.signal, Some(9), "{ended:?}");
        assert!(!dir.exists(), "{} is left", dir.display());
    }
}
