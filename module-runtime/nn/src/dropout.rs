//! Dropout.

use crate::common::layer_repr;
use crate::common::{forward_by_value, layer_forward};
use crate::error::Result;
use crate::{Mode, Module};
use candle_core::Tensor;
use module_core::py_float;

/// Randomly zeroes elements during training: PyTorch's `nn.Dropout(p)`.
///
/// In training mode (see [`Mode`]) each element is zeroed with probability `p` and the others are
/// scaled by `1 / (1 - p)`, so the expected value is unchanged; in evaluation mode the layer is the
/// identity. Any shape in, the same shape out. No parameters.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Dropout;
/// let dropout = Dropout::new(0.5);
/// let x = Tensor::ones((4, 100), DType::F32, &Device::Cpu)?;
/// let y = dropout.call(&x)?; // training: zeros and 2.0s
/// assert!(y.flatten_all()?.to_vec1::<f32>()?.iter().all(|&v| v == 0.0 || v == 2.0));
/// dropout.eval();
/// assert_eq!(dropout.call(&x)?.to_vec2::<f32>()?, x.to_vec2::<f32>()?);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`DropoutPath`], from [`Dropout::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct Dropout {
    /// Probability of zeroing an element, in `[0, 1]`.
    pub p: f64,
    /// Training or evaluation mode.
    pub mode: Mode,
}

impl Dropout {
    /// Dropout with probability `p`, in training mode.
    ///
    /// # Panics
    ///
    /// If `p` is not in `[0, 1]`, as PyTorch raises.
    pub fn new(p: f64) -> Self {
        assert!(
            (0.0..=1.0).contains(&p),
            "dropout probability has to be between 0 and 1, but got {p}"
        );
        Self {
            p,
            mode: Mode::new(),
        }
    }
}

layer_forward!(Dropout, |layer, x| {
    if !layer.mode.is_training() {
        return Ok(x.clone());
    }
    dropout_in_training(x, layer.p)
});

/// Dropout with probability `p` in training: `x` for 0, zeros for 1 (or more), otherwise
/// [`module_kernels::dropout`], whose draws are the runtime's generator's (`manual_seed`): for
/// every layer that drops, so that a seeded run repeats.
pub(crate) fn dropout_in_training(x: &Tensor, p: f64) -> Result<Tensor> {
    if p <= 0.0 {
        return Ok(x.clone());
    }
    if p >= 1.0 {
        return Ok(x.zeros_like()?);
    }
    module_kernels::dropout(x, p)
}

layer_repr!(Dropout, |layer| dropout_repr(layer.p));

/// PyTorch's `extra_repr` of every dropout layer: `p=0.1, inplace=False`.
pub(crate) fn dropout_repr(p: f64) -> String {
    format!("p={}, inplace=False", py_float(p))
}

forward_by_value!(Dropout);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Result;
    use crate::Forward;
    use crate::ModuleExt;
    use candle_core::Device;
    use candle_core::{DType, Tensor};

    #[test]
    fn training_drops_about_p_and_keeps_the_mean() -> Result<()> {
        let x = Tensor::ones(10_000, DType::F32, &Device::Cpu)?;
        let y = Dropout::new(0.3).forward(&x)?.to_vec1::<f32>()?;
        let zeros = y.iter().filter(|&&v| v == 0.0).count() as f64 / y.len() as f64;
        assert!((zeros - 0.3).abs() < 0.03, "dropped {zeros}");
        let mean = y.iter().sum::<f32>() / y.len() as f32;
        assert!((mean - 1.0).abs() < 0.05, "mean {mean}");
        Ok(())
    }

    #[test]
    fn p_one_drops_everything_and_eval_is_identity() -> Result<()> {
        let x = Tensor::ones(5, DType::F32, &Device::Cpu)?;
        let d = Dropout::new(1.0);
        assert_eq!(d.forward(&x)?.to_vec1::<f32>()?, [0.0; 5]);
        d.eval();
        assert_eq!(d.forward(&x)?.to_vec1::<f32>()?, [1.0; 5]);
        Ok(())
    }
}
