//! Support code for this workspace's examples and integration tests — not part of the library,
//! which is `module-runtime`:
//!
//! - [`digits`]: the bundled digits data set and [`DigitNet`], the model the examples and
//!   benchmarks train on it;
//! - [`device_from_env`]: the device under test, from `MODULE_DEVICE`;
//! - [`fixtures`]: PyTorch reference fixtures for the parity tests;
//! - [`bert`]: a BERT encoder that loads Hugging Face checkpoints.

pub mod bert;
mod device;
pub mod digits;
pub mod fixtures;

pub use device::{device_from_env, DEVICE_ENV};
pub use digits::{digits_path, DigitNet, Digits};
