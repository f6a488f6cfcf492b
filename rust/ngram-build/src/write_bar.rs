//! The progress bar of a long write into a model (`dart-ngram merge`, a build's writing
//! phase), drawn on stderr from the [`WriteProgress`] counters the writer keeps, by a thread
//! of its own until dropped.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use dart_ngram::writer::WriteProgress;
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Draws until dropped; hidden when stderr is not a terminal.
pub struct WriteBar {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl WriteBar {
    /// `reading`: what the producer's input counters count (e.g. "input n-grams merged"); with
    /// no input total set, a spinner shows it until the sections are laid out.
    pub fn start(progress: Arc<WriteProgress>, reading: &str) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let reading = reading.to_string();
        let thread = {
            let stop = stop.clone();
            std::thread::spawn(move || draw(&progress, &stop, &reading))
        };
        WriteBar {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for WriteBar {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn draw(progress: &WriteProgress, stop: &AtomicBool, reading: &str) {
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(4));
    let style = |template: &str| {
        ProgressStyle::with_template(template).unwrap_or_else(|_| ProgressStyle::default_bar())
    };
    let counting = style("{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% {msg}");
    bar.set_style(style("{spinner} [{elapsed_precise}] {msg}"));
    let mut counted = false;
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    while !stop.load(Ordering::Relaxed) {
        let (written, size) = (load(&progress.output_done), load(&progress.output_total));
        let (read, total) = (load(&progress.input_done), load(&progress.input_total));
        let (done, len, message) = if size > 0 {
            let message = format!("writing: {} of {}", HumanBytes(written), HumanBytes(size));
            (written, size, message)
        } else if total > 0 {
            let message = format!("{reading}: {:.3e} of {:.3e}", read as f64, total as f64);
            (read, total, message)
        } else {
            // Nothing to count yet: a spinner.
            bar.set_message(reading.to_string());
            std::thread::sleep(Duration::from_millis(100));
            continue;
        };
        if !counted {
            bar.set_style(counting.clone());
            counted = true;
        }
        // Length and position in one update: a draw between two would mix the phases.
        bar.update(|state| {
            state.set_len(len);
            state.set_pos(done);
        });
        bar.set_message(message);
        std::thread::sleep(Duration::from_millis(100));
    }
    bar.finish_and_clear();
}
