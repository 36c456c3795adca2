//! The device the examples and tests run on.

use module_runtime::candle_core::Device;
use module_runtime::parse_device;

/// The environment variable tests and examples read their device from.
pub const DEVICE_ENV: &str = "MODULE_DEVICE";

/// The device named by `MODULE_DEVICE` (see [`parse_device`]), or the CPU when it is unset or
/// empty.
///
/// Tests, benchmarks and examples (without `--device`) take their device from here, so `MODULE_DEVICE=cuda:0 cargo test
/// --workspace --features cuda` runs them on a GPU.
pub fn device_from_env() -> module_runtime::Result<Device> {
    match std::env::var(DEVICE_ENV) {
        Ok(name) if !name.is_empty() => parse_device(&name),
        _ => Ok(Device::Cpu),
    }
}

/// The device named `name` (an example's `--device`), else [`device_from_env`]'s.
pub fn device_or_env(name: Option<&str>) -> module_runtime::Result<Device> {
    match name {
        Some(name) => parse_device(name),
        None => device_from_env(),
    }
}
