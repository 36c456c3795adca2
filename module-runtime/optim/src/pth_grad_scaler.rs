//! A `GradScaler`'s state that PyTorch saved (`torch.save({"scaler": scaler.state_dict(), …})`),
//! read from a checkpoint's [`PyValue`]s into the state dict [`GradScaler::load_state_dict`]
//! takes.

use candle_core::{Device, Tensor};
use module_state::{PyValue, StateDict};

use crate::error::Result;
use crate::grad_scaler::invalid_value;
#[cfg(doc)]
use crate::grad_scaler::GradScaler;

/// Reads the state PyTorch's `GradScaler.state_dict()` saved (a dict of plain numbers, as
/// `torch.save({"scaler": scaler.state_dict(), …})` writes it) into the state dict
/// [`GradScaler::load_state_dict`] takes:
///
/// ```
/// use module_runtime::optim::{read_pth_grad_scaler_state, GradScaler, GradScalerOptions};
/// use module_runtime::PthValues;
/// # let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/pytorch/swa/grad_scaler.pt");
/// let mut scaler = GradScaler::new(GradScalerOptions::default())?;
/// // scaler.load_state_dict(torch.load(path)["scaler"])
/// let ckpt = PthValues::load(path)?;
/// scaler.load_state_dict(&read_pth_grad_scaler_state(ckpt.get("scaler")?)?)?;
/// assert_eq!(scaler.get_scale(), 65536.0);
/// assert_eq!(scaler.get_growth_interval(), 3);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// Every value must be a number ([`StateError::InvalidValue`](crate::StateError::InvalidValue) otherwise); which keys there are
/// is checked by the load. An empty dict (a disabled scaler's) reads as an empty state.
pub fn read_pth_grad_scaler_state(state: &PyValue) -> Result<StateDict> {
    let items = state.as_dict().ok_or_else(|| {
        invalid_value(
            "scaler",
            format!("is {}, not a GradScaler's state dict", state.describe()),
        )
    })?;
    let mut out = StateDict::new();
    for (k, v) in items {
        let PyValue::Str(name) = k else {
            return Err(invalid_value(
                "scaler",
                format!("has the key {}, not a field name", k.describe()),
            ));
        };
        let at = |reason: String| invalid_value(&format!("scaler['{name}']"), reason);
        let t = match v {
            PyValue::Int(i) => Tensor::new(*i, &Device::Cpu)?,
            _ => {
                let x: f64 = v
                    .extract()
                    .ok_or_else(|| at(format!("is {}, not a number", v.describe())))?;
                Tensor::new(x, &Device::Cpu)?
            }
        };
        out.insert(name.as_str(), t);
    }
    Ok(out)
}
