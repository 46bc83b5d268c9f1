//! A one-line progress bar on standard error, shown only when standard output is a terminal.

use std::io::Write;

/// Counts work items and redraws the bar.
pub struct Progress {
    shown: bool,
    total: usize,
    done: usize,
}

impl Progress {
    /// A bar over `total` items; silent unless stdout is a terminal.
    pub fn new(total: usize) -> Self {
        // SAFETY: isatty only inspects the descriptor.
        let terminal = unsafe { libc::isatty(1) == 1 && libc::isatty(2) == 1 };
        Self {
            shown: terminal,
            total: total.max(1),
            done: 0,
        }
    }

    /// Marks the start of the next item, named `what`.
    pub fn step(&mut self, what: &str) {
        self.done = (self.done + 1).min(self.total);
        if self.shown {
            let filled = 30 * self.done / self.total;
            eprint!(
                "\r\x1b[2K[{}{}] {}/{} {what}",
                "#".repeat(filled),
                " ".repeat(30 - filled),
                self.done,
                self.total
            );
            let _ = std::io::stderr().flush();
        }
    }

    /// Clears the bar.
    pub fn finish(&mut self) {
        if self.shown {
            eprint!("\r\x1b[2K");
            let _ = std::io::stderr().flush();
        }
    }
}
