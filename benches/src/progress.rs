//! A one-line progress bar on standard error, shown only when standard output and standard
//! error are both a terminal.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Counts work items and redraws the bar.
pub struct Progress {
    bar: ProgressBar,
}

impl Progress {
    /// A bar over `total` items; silent unless stdout and stderr are a terminal.
    pub fn new(total: usize) -> Self {
        let shown = std::io::stdout().is_terminal() && std::io::stderr().is_terminal();
        let bar = ProgressBar::with_draw_target(
            Some(total.max(1) as u64),
            if shown {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        bar.set_style(
            ProgressStyle::with_template("[{bar:30}] {pos}/{len} {msg}")
                .expect("a valid template")
                .progress_chars("## "),
        );
        Self { bar }
    }

    /// Marks the start of the next item, named `what`.
    pub fn step(&mut self, what: &str) {
        if self.bar.position() < self.bar.length().unwrap_or(0) {
            self.bar.inc(1);
        }
        self.bar.set_message(what.to_owned());
    }

    /// Clears the bar.
    pub fn finish(&mut self) {
        self.bar.finish_and_clear();
    }
}
