//! A parametrized tensor's stand-in: the [`Param`] a layer keeps in its field while a
//! parametrization (`module_runtime::nn::parametrize`) computes the tensor from its originals.
//!
//! PyTorch removes the parametrized parameter from the module (`module.weight` becomes a property
//! computed from `module.parametrizations.weight.original*`). A Rust layer's `weight` field cannot
//! disappear, so it holds a stand-in instead: a parameter that every walk skips (it is in no
//! `named_parameters`, state dict, optimizer or move; its originals are, under PyTorch's keys) and
//! that refuses to be read or written ([`ParametrizeError::StandIn`]), so that no code reads a
//! stale value where PyTorch would compute the current one.

use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::error::{ParametrizeError, Result};
use crate::identity::ModeMarks;
use crate::lazy_cell::LazyCell;
use crate::param::{Param, ParamInner};
use crate::quant_slot::QuantSlot;

impl Param {
    /// A stand-in for a parametrized tensor of `like`'s shape, dtype and device, sharing `like`'s
    /// storage (no copy): hidden from every walk, and [`ParametrizeError::StandIn`] when read
    /// ([`tensor`](Self::tensor), [`var`](Self::var)) or written ([`set`](Self::set),
    /// [`assign`](Self::assign)). Its [`shape`](Self::shape) is the parametrized tensor's.
    ///
    /// The parametrizations (`nn::parametrize`) put one in the layer's field; users do not need
    /// to build one.
    ///
    /// ```
    /// use module_runtime::{Error, Param, ParametrizeError, candle_core::{DType, Device, Tensor}};
    /// let w = Param::new(Tensor::zeros((2, 3), DType::F32, &Device::Cpu)?)?;
    /// let stand_in = Param::parametrized_stand_in(&w);
    /// assert!(stand_in.is_parametrized() && !w.is_parametrized());
    /// assert_eq!(stand_in.shape().dims(), [2, 3]);
    /// assert!(matches!(stand_in.tensor(), Err(Error::Parametrize(ParametrizeError::StandIn))));
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn parametrized_stand_in(like: &Param) -> Param {
        let var = like.read().clone();
        Param(Arc::new(ParamInner {
            modes: ModeMarks::default(),
            var: LazyCell::eager(var),
            requires_grad: AtomicBool::new(false),
            quant: QuantSlot::default(),
            offload: Default::default(),
            parametrized: true,
        }))
    }

    /// Whether this is a parametrized tensor's stand-in ([`parametrized_stand_in`](Self::parametrized_stand_in)).
    pub fn is_parametrized(&self) -> bool {
        self.0.parametrized
    }

    /// [`ParametrizeError::StandIn`] for a stand-in.
    #[inline]
    pub(crate) fn refuse_parametrized(&self) -> Result<()> {
        if self.0.parametrized {
            return Err(ParametrizeError::StandIn.into());
        }
        Ok(())
    }
}
