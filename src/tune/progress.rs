//! A progress bar on stderr while `ferry tune` runs: redrawn in place on a terminal, one line per
//! point otherwise (CI logs, pipes).
use std::{
    io::{IsTerminal, Write},
    time::Instant,
};

pub struct Progress {
    total: usize,
    done: usize,
    deadline: Instant,
    tty: bool,
    current: String,
}

const WIDTH: usize = 24;

impl Progress {
    pub fn new(total: usize, deadline: Instant) -> Self {
        Progress {
            total: total.max(1),
            done: 0,
            deadline,
            tty: std::io::stderr().is_terminal(),
            current: String::new(),
        }
    }

    fn bar(&self) -> String {
        let filled = (self.done * WIDTH / self.total).min(WIDTH);
        let left = self.deadline.saturating_duration_since(Instant::now()).as_secs();
        format!(
            "[{}{}] {}/{} points, {left} s left",
            "#".repeat(filled),
            ".".repeat(WIDTH - filled),
            self.done,
            self.total
        )
    }

    fn draw(&self, line: &str) {
        let mut err = std::io::stderr().lock();
        if self.tty {
            let _ = write!(err, "\r\x1b[2K{} {line}", self.bar());
        } else {
            let _ = writeln!(err, "ferry tune {} {line}", self.bar());
        }
        let _ = err.flush();
    }

    pub fn note(&mut self, what: &str) {
        self.draw(what);
    }

    pub fn start(&mut self, what: &str) {
        self.current = what.to_string();
        if self.tty {
            self.draw(&format!("measuring {what}"));
        }
    }

    pub fn done(&mut self, best_throughput: f64) {
        self.done += 1;
        let line = format!("{}: up to {best_throughput:.1} requests/s", self.current);
        self.draw(&line);
    }

    pub fn skip(&mut self, what: &str) {
        self.done += 1;
        self.draw(&format!("skipped (budget spent): {what}"));
    }

    pub fn fail(&mut self, what: &str) {
        self.done += 1;
        self.draw(&format!("did not load: {what}"));
    }

    pub fn finish(&mut self) {
        if self.tty {
            let _ = writeln!(std::io::stderr());
        }
    }
}
