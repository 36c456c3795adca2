//! The progress bar the training examples show.

use indicatif::{ProgressBar, ProgressStyle};

/// A bar over `total_steps` optimizer steps, showing the epoch (`set_prefix`) and the latest loss
/// (`set_message`).
pub fn training_bar(total_steps: usize) -> ProgressBar {
    let style =
        ProgressStyle::with_template("{bar:40} {pos}/{len} steps, epoch {prefix}, loss {msg}")
            .expect("a valid progress template");
    ProgressBar::new(total_steps as u64).with_style(style)
}
