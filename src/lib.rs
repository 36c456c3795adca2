//! Support code for this workspace's examples and integration tests — not part of the library,
//! which is `module-runtime`:
//!
//! - [`digits`]: the bundled digits data set and [`DigitNet`], the model the examples and
//!   benchmarks train on it;
//! - [`device_from_env`]: the device under test, from `MODULE_DEVICE` ([`device_or_env`] for an
//!   example's `--device`);
//! - [`fixtures`]: PyTorch reference fixtures for the parity tests;
//! - [`training_bar`]: the training examples' progress bar;
//! - [`process_memory_mib`]: this process's resident memory, for the memory benchmarks.
//!
//! The BERT model and everything that runs all-MiniLM-L6-v2 (examples, tests, benchmarks) are the
//! `minilm` package, so that the examples here build without a tokenizer or a JSON parser.

mod device;
pub mod digits;
pub mod fixtures;
mod memory;
mod progress;

pub use device::{device_from_env, device_or_env, DEVICE_ENV};
pub use digits::{digits_path, DigitNet, Digits};
pub use memory::{process_cpu_time, process_memory_mib};
pub use progress::training_bar;
