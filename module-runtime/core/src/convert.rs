//! Moves and conversions of a whole model (`to_device`, `to_dtype`), all or nothing.

use candle_core::{DType, Device, Tensor, Var};

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::module::Module;
use crate::names::{named_buffers, named_parameters, Names};
use crate::param::Param;

/// Moves every parameter and buffer under `root` to `device`; quantized weights move with their
/// parameters. Offloaded parameters (`dispatch_model`'s `cpu` and `disk` placements) stay where
/// their values are kept, for this move and [`to_dtype`].
pub fn to_device(root: &dyn Module, device: &Device) -> Result<()> {
    let quantized: Vec<(Param, _)> = named_parameters(root, &Names::new())
        .into_iter()
        .filter(|(_, p)| p.is_quantized())
        .map(|(_, p)| p.quant_on(device).map(|q| (p, q)))
        .collect::<Result<_>>()?;
    convert(
        root,
        |p| match p.is_offloaded() || p.device().same_device(device) {
            true => Ok(None),
            false => Ok(Some(p.read().as_tensor().to_device(device)?)),
        },
        |b| match b.device().same_device(device) {
            true => Ok(None),
            false => Ok(Some(b.current().to_device(device)?)),
        },
        // The quantized weights, moved above, are installed in the same update.
        || {
            for (p, q) in quantized {
                p.replace_quant(q);
            }
        },
    )
}

/// Converts every floating-point parameter and buffer under `root` to the floating-point `dtype`.
pub fn to_dtype(root: &dyn Module, dtype: DType) -> Result<()> {
    if !dtype.is_float() {
        return Err(Error::NonFloatDType { dtype });
    }
    convert(
        root,
        |p| match p.is_offloaded() || p.dtype() == dtype {
            true => Ok(None),
            false => Ok(Some(p.read().as_tensor().to_dtype(dtype)?)),
        },
        |b| match !b.dtype().is_float() || b.dtype() == dtype {
            true => Ok(None),
            false => Ok(Some(b.current().to_dtype(dtype)?)),
        },
        || {},
    )
}

/// Converts every parameter and buffer, committing only once every conversion has succeeded; the
/// commit, with `also`, is one update.
fn convert(
    root: &dyn Module,
    param: impl Fn(&Param) -> Result<Option<Tensor>>,
    buffer: impl Fn(&Buffer) -> Result<Option<Tensor>>,
    also: impl FnOnce(),
) -> Result<()> {
    let params: Vec<Param> = named_parameters(root, &Names::new())
        .into_iter()
        .map(|(_, p)| p)
        .collect();
    let buffers: Vec<Buffer> = named_buffers(root, &Names::new())
        .into_iter()
        .map(|(_, b)| b)
        .collect();
    let new_params = params.iter().map(&param).collect::<Result<Vec<_>>>()?;
    let new_buffers = buffers.iter().map(&buffer).collect::<Result<Vec<_>>>()?;
    let new_vars = new_params
        .into_iter()
        .map(|t| t.map(|t| Var::from_tensor(&t)).transpose())
        .collect::<candle_core::Result<Vec<_>>>()?;
    // One update: a call on another thread sees the whole model moved, or none of it.
    crate::update_lock::atomic_update(|| {
        for (p, var) in params.iter().zip(new_vars) {
            if let Some(var) = var {
                p.replace_var(var);
            }
        }
        for (b, t) in buffers.iter().zip(new_buffers) {
            if let Some(t) = t {
                b.replace(t);
            }
        }
        also();
    });
    Ok(())
}
