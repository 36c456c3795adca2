//! Choosing a device by name: `cpu`, `cuda:0`, `metal:0`.

use candle_core::Device;

use crate::error::{Error, Result};

/// The environment variable tests and examples read their device from.
pub const DEVICE_ENV: &str = "MODULE_DEVICE";

/// Parses a device name: `cpu`, `cuda` / `cuda:N`, `metal` / `metal:N`.
///
/// A CUDA or Metal device fails with candle's error when the crate was built without the matching
/// feature (`cuda`, `metal`) or no such device exists.
///
/// ```
/// let dev = module_runtime::parse_device("cpu")?;
/// assert!(dev.is_cpu());
/// assert!(module_runtime::parse_device("tpu:0").is_err());
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn parse_device(name: &str) -> Result<Device> {
    let (kind, ordinal) = match name.split_once(':') {
        Some((kind, n)) => (kind, n.parse::<usize>().map_err(|_| bad(name))?),
        None => (name, 0),
    };
    match kind {
        "cpu" if ordinal == 0 => Ok(Device::Cpu),
        "cuda" => Ok(Device::new_cuda(ordinal)?),
        "metal" => Ok(Device::new_metal(ordinal)?),
        _ => Err(bad(name)),
    }
}

/// The device named by `MODULE_DEVICE`, or the CPU when it is unset.
pub fn device_from_env() -> Result<Device> {
    match std::env::var(DEVICE_ENV) {
        Ok(name) if !name.is_empty() => parse_device(&name),
        _ => Ok(Device::Cpu),
    }
}

fn bad(name: &str) -> Error {
    Error::InvalidDevice {
        name: name.to_owned(),
    }
}
