//! The one progress line of the CLI: redrawn in place on stderr when it is a terminal, silent
//! otherwise (and under `--json`), so piped output stays clean.

use std::io::{IsTerminal, Write};

/// A progress line on stderr.
pub(crate) struct Progress {
    on: bool,
}

impl Progress {
    /// Draws when `wanted` and stderr is a terminal.
    pub(crate) fn on_stderr(wanted: bool) -> Self {
        Self {
            on: wanted && std::io::stderr().is_terminal(),
        }
    }

    /// Replaces the line with `text`.
    pub(crate) fn show(&self, text: &str) {
        if self.on {
            eprint!("\r\x1b[2K{text}");
            let _ = std::io::stderr().flush();
        }
    }

    /// Replaces the line with a bar of `done` out of `total`, then `text`.
    pub(crate) fn bar(&self, done: u64, total: u64, text: &str) {
        if self.on {
            self.show(&bar_line(done, total, text));
        }
    }

    /// Erases the line.
    pub(crate) fn clear(&self) {
        if self.on {
            eprint!("\r\x1b[2K");
            let _ = std::io::stderr().flush();
        }
    }
}

fn bar_line(done: u64, total: u64, text: &str) -> String {
    const WIDTH: u64 = 30;
    let filled = (done.min(total) * WIDTH / total.max(1)) as usize;
    format!(
        "  [{}{}] {done}/{total} {text}",
        "#".repeat(filled),
        ".".repeat(WIDTH as usize - filled)
    )
}

#[cfg(test)]
mod tests {
    use super::bar_line;

    #[test]
    fn the_bar_fills_in_proportion_and_never_overflows() {
        assert_eq!(bar_line(0, 3, "x"), format!("  [{}] 0/3 x", ".".repeat(30)));
        assert_eq!(
            bar_line(1, 3, "x"),
            format!("  [{}{}] 1/3 x", "#".repeat(10), ".".repeat(20))
        );
        assert_eq!(bar_line(5, 3, "x"), format!("  [{}] 5/3 x", "#".repeat(30)));
        assert_eq!(bar_line(0, 0, "x"), format!("  [{}] 0/0 x", ".".repeat(30)));
    }
}
