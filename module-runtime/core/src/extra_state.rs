//! Extra state: a module's non-tensor state, saved in the state dict under
//! `<module path>._extra_state` (PyTorch's `get_extra_state` / `set_extra_state`).

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};

/// The key suffix PyTorch saves extra state under (`_EXTRA_STATE_KEY_SUFFIX` in
/// `torch/nn/modules/module.py`): `"_extra_state"` for the root, `"enc._extra_state"` for the
/// module at `enc`.
pub const EXTRA_STATE_KEY: &str = "_extra_state";

/// A module's state that is not a parameter or a buffer (a counter, a vocabulary, a config the
/// checkpoint must carry), saved and restored through the state dict: PyTorch's
/// `Module.get_extra_state` / `Module.set_extra_state`.
///
/// Implement it for a module type and mark the type `#[module(extra_state)]`: the module's
/// [`state_dict`](../module_runtime/trait.ModuleExt.html#method.state_dict) then holds `get_extra_state()` under
/// `<path>._extra_state`, after the module's own parameters and buffers and before its
/// submodules' (`Module._save_to_state_dict`), and a load calls `set_extra_state` with the value
/// found there. In a load, a missing `_extra_state` key is reported as missing (a strict load
/// fails), and an `_extra_state` key for a module without extra state is unexpected
/// (`Module._load_from_state_dict`).
///
/// **Deviation:** PyTorch stores any picklable object; a checkpoint here must be safetensors, so
/// the state is a [`Tensor`]: one of your choosing (a step count as an `i64` scalar), or bytes
/// in a `u8` tensor ([`extra_state_from_bytes`] / [`extra_state_to_bytes`], for instance around
/// `serde_json`). A `.pth` holding a pickled Python object as `_extra_state` cannot be read.
///
/// Loading takes `&self`, so the state lives behind interior mutability (a `Mutex`, an atomic),
/// as a [`Buffer`](crate::Buffer)'s value does. `set_extra_state` receives a CPU tensor, before any
/// parameter is copied; it should check its value and fail rather than keep part of it. Loads
/// stay all or nothing: if one module's `set_extra_state` fails, the modules whose extra state
/// was already set get their previous `get_extra_state()` value back, and no parameter changes.
///
/// ```
/// use std::sync::atomic::{AtomicI64, Ordering};
/// use module_runtime::prelude::*;
/// use module_runtime::ExtraState;
///
/// #[derive(Module)]
/// #[module(extra_state)]
/// struct Counter {
///     fc: Linear,
///     #[module(skip)]
///     steps: AtomicI64,
/// }
///
/// impl ExtraState for Counter {
///     fn get_extra_state(&self) -> Result<Tensor> {
///         Ok(Tensor::new(self.steps.load(Ordering::Relaxed), &Device::Cpu)?)
///     }
///     fn set_extra_state(&self, state: &Tensor) -> Result<()> {
///         self.steps.store(state.to_scalar::<i64>()?, Ordering::Relaxed);
///         Ok(())
///     }
/// }
///
/// let a = Counter { fc: Linear::new(2, 2, &Device::Cpu)?, steps: AtomicI64::new(7) };
/// let sd = a.state_dict()?;
/// assert_eq!(sd.keys().collect::<Vec<_>>(), ["_extra_state", "fc.weight", "fc.bias"]);
/// let b = Counter { fc: Linear::new(2, 2, &Device::Cpu)?, steps: AtomicI64::new(0) };
/// b.load_state_dict(&sd, &LoadOptions::default())?;
/// assert_eq!(b.steps.load(Ordering::Relaxed), 7);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[doc(alias = "get_extra_state")]
#[doc(alias = "set_extra_state")]
pub trait ExtraState: Send + Sync {
    /// The state to save (PyTorch's `get_extra_state`).
    fn get_extra_state(&self) -> Result<Tensor>;

    /// Restores the state from what [`get_extra_state`](Self::get_extra_state) saved (PyTorch's
    /// `set_extra_state`). The tensor is on the CPU.
    fn set_extra_state(&self, state: &Tensor) -> Result<()>;
}

/// Bytes as extra state: a 1-D `u8` tensor on the CPU.
pub fn extra_state_from_bytes(bytes: &[u8]) -> Result<Tensor> {
    Ok(Tensor::from_slice(bytes, bytes.len(), &Device::Cpu)?)
}

/// The bytes of extra state saved by [`extra_state_from_bytes`]. Fails on a tensor that is not a
/// 1-D `u8` tensor.
pub fn extra_state_to_bytes(state: &Tensor) -> Result<Vec<u8>> {
    if state.dtype() != DType::U8 || state.rank() != 1 {
        return Err(Error::Candle(candle_core::Error::Msg(format!(
            "extra state holds a {:?} tensor of shape {:?}, not bytes (a 1-D U8 tensor)",
            state.dtype(),
            state.dims()
        ))));
    }
    Ok(state.to_vec1::<u8>()?)
}

/// Sets each module's extra state; if one fails, puts back the earlier ones' previous state and
/// returns the error ([`Error::ExtraState`]) naming the path.
pub fn commit(staged: &[(&str, &dyn ExtraState, Tensor)]) -> Result<()> {
    let mut done: Vec<(&dyn ExtraState, Tensor)> = Vec::with_capacity(staged.len());
    for &(path, module, ref value) in staged {
        let failed = match module.get_extra_state() {
            Ok(old) => match module.set_extra_state(value) {
                Ok(()) => {
                    done.push((module, old));
                    continue;
                }
                Err(e) => e,
            },
            Err(e) => e,
        };
        for (module, old) in done.iter().rev() {
            let _restored = module.set_extra_state(old);
        }
        return Err(Error::ExtraState {
            path: path.to_owned(),
            source: Box::new(failed),
        });
    }
    Ok(())
}
