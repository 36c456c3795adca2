//! Choosing a device by name (`cpu`, `cuda:0`, `metal:0`), and checking that a layer's input is on
//! its parameters' device.

use std::sync::{Mutex, PoisonError};

use candle_core::{Device, DeviceLocation, Tensor};

use crate::error::{location_name, Error, Result};

/// Parses a device name: `cpu`, `cuda` / `cuda:N`, `metal` / `metal:N`.
///
/// A name gives the same device every time it is parsed in a process. candle tells CUDA and Metal
/// devices apart by handle, not by ordinal: two `Device::new_cuda(0)` calls make two devices whose
/// tensors cannot be combined, so a model built on `parse_device("cuda:0")` in one place and an
/// input made on `parse_device("cuda:0")` in another must share one handle.
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
    let location = match kind {
        "cpu" if ordinal == 0 => return Ok(Device::Cpu),
        "cuda" => DeviceLocation::Cuda { gpu_id: ordinal },
        "metal" => DeviceLocation::Metal { gpu_id: ordinal },
        _ => return Err(bad(name)),
    };
    // Devices opened so far, by location; a handful at most, so a list is enough.
    static OPENED: Mutex<Vec<(DeviceLocation, Device)>> = Mutex::new(Vec::new());
    let mut opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, device)) = opened.iter().find(|(l, _)| *l == location) {
        return Ok(device.clone());
    }
    let device = match location {
        DeviceLocation::Cuda { gpu_id } => Device::new_cuda(gpu_id)?,
        DeviceLocation::Metal { gpu_id } => Device::new_metal(gpu_id)?,
        DeviceLocation::Cpu => Device::Cpu,
    };
    opened.push((location, device.clone()));
    Ok(device)
}

fn bad(name: &str) -> Error {
    Error::InvalidDevice {
        name: name.to_owned(),
    }
}

/// A device's name as [`parse_device`] reads it: `cpu`, `cuda:0`, `metal:0`.
///
/// ```
/// use module_runtime::{candle_core::Device, device_name};
/// assert_eq!(device_name(&Device::Cpu), "cpu");
/// ```
pub fn device_name(device: &Device) -> String {
    location_name(&device.location())
}

/// Checks that `input` is on the device of `param`, the parameter (or buffer) a layer computes it
/// with, named `path` as `Layer.parameter`.
///
/// Layers call this where they take input, so that a model on one device called with a tensor on
/// another fails with [`Error::DeviceMismatch`](crate::Error::DeviceMismatch) naming both, rather than with candle's error from
/// inside whichever op first combines them. It costs one comparison (a discriminant for the CPU, a
/// handle id for CUDA and Metal).
pub fn check_input_device(path: &'static str, param: &Tensor, input: &Tensor) -> Result<()> {
    check_device(path, param.device(), input)
}

/// [`check_input_device`] for a parameter known by its device alone (a quantized weight holds no
/// float tensor to ask).
pub fn check_device(path: &'static str, device: &Device, input: &Tensor) -> Result<()> {
    if input.device().same_device(device) {
        return Ok(());
    }
    Err(Error::DeviceMismatch {
        path: path.to_owned(),
        expected: device.location(),
        got: input.device().location(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_parse_device() {
        for location in [
            DeviceLocation::Cpu,
            DeviceLocation::Cuda { gpu_id: 1 },
            DeviceLocation::Metal { gpu_id: 0 },
        ] {
            let name = location_name(&location);
            // Without the feature (or the hardware) parsing fails in candle, not as an unknown name.
            match parse_device(&name) {
                Ok(device) => assert_eq!(device.location(), location),
                Err(e) => assert!(!matches!(e, Error::InvalidDevice { .. }), "{name}: {e}"),
            }
        }
        for bad_name in ["cpu:1", "cuda:x", "gpu", ""] {
            assert!(
                matches!(parse_device(bad_name), Err(Error::InvalidDevice { .. })),
                "{bad_name}"
            );
        }
    }

    #[test]
    fn inputs_on_the_parameters_device_pass() -> Result<()> {
        let w = Tensor::zeros((2, 2), candle_core::DType::F32, &Device::Cpu)?;
        let x = Tensor::zeros(2, candle_core::DType::F32, &Device::Cpu)?;
        check_input_device("Linear.weight", &w, &x)
    }

    /// A real mismatch needs two devices (`tests/devices.rs` makes one when `MODULE_DEVICE` names a
    /// GPU); the message is checked here.
    #[test]
    fn a_mismatch_names_both_devices_and_the_fix() {
        let err = Error::DeviceMismatch {
            path: "Linear.weight".into(),
            expected: DeviceLocation::Cuda { gpu_id: 0 },
            got: DeviceLocation::Cpu,
        };
        assert_eq!(
            err.to_string(),
            "`Linear.weight` is on cuda:0 but the input is on cpu: move the input \
             (`x.to_device(..)`) or the model (`model.to_device(..)`) so that both are on one device"
        );
        let same_gpu = Error::DeviceMismatch {
            path: "Conv2d.weight".into(),
            expected: DeviceLocation::Cuda { gpu_id: 0 },
            got: DeviceLocation::Cuda { gpu_id: 0 },
        };
        assert!(same_gpu.to_string().ends_with(
            "(two handles for one GPU: create the device once, e.g. with `parse_device`)"
        ));
    }
}
