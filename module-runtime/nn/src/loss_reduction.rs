//! What the loss modules share: PyTorch's `reduction` argument and the shape checks of their
//! inputs.

use candle_core::Tensor;

use crate::error::{Error, Result};

/// How a loss module reduces the per-element (or per-sample) losses: PyTorch's `reduction`
/// argument (`'mean'`, the default, `'sum'` or `'none'`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LossReduction {
    /// The per-element losses, unreduced (PyTorch's `'none'`).
    None,
    /// Their mean, a 0-dim tensor (PyTorch's `'mean'`; losses with class weights divide by the
    /// sum of the weights used, as PyTorch does).
    #[default]
    Mean,
    /// Their sum, a 0-dim tensor (PyTorch's `'sum'`).
    Sum,
}

impl LossReduction {
    /// `loss` reduced: unchanged, averaged over all elements, or summed.
    pub(crate) fn apply(self, loss: Tensor) -> Result<Tensor> {
        Ok(match self {
            Self::None => loss,
            Self::Mean => loss.mean_all()?,
            Self::Sum => loss.sum_all()?,
        })
    }
}

/// [`Error::InputShape`] unless `got` has the shape of `like`; `what` names `got` in the message
/// (`"the target (the input's shape)"`): losses and distances take operands of one shape.
pub(crate) fn check_same_shape(
    layer: &'static str,
    got: &Tensor,
    like: &Tensor,
    what: &str,
) -> Result<()> {
    if got.dims() == like.dims() {
        return Ok(());
    }
    Err(Error::InputShape {
        layer,
        expected: format!("{:?} for {what}", like.dims()),
        got: got.shape().clone(),
    })
}

/// `new` (PyTorch's defaults: no weight, mean) and `with_config(weight, reduction)` of a loss whose
/// fields are an optional `weight` buffer and a `reduction`; `$weight` says what the weight is.
macro_rules! weighted_loss_constructors {
    ($ty:ident, $weight:literal) => {
        impl $ty {
            /// PyTorch's defaults: no weight, mean.
            pub fn new() -> Self {
                Self::default()
            }

            #[doc = concat!("With `weight` (", $weight, ") and `reduction`.")]
            pub fn with_config(weight: Option<Tensor>, reduction: LossReduction) -> Self {
                Self {
                    weight: weight.map(Buffer::new),
                    reduction,
                }
            }
        }
    };
}
pub(crate) use weighted_loss_constructors;
