//! The escape hatch to plain candle: closures and candle-nn layers as modules.
//!
//! - [`Functional`] turns any function of a tensor, or any parameterless `candle_core::Module`
//!   (`candle_nn::Activation`, a closure), into a leaf module, so it can sit in a
//!   [`Sequential`](crate::Sequential) or a derived struct.
//! - [`Native`] wraps one of candle-nn's own layers with weights (`Linear`, `Embedding`,
//!   `LayerNorm`, `Conv1d`, `Conv2d`) so that its weights appear in traversal, state dicts and
//!   `trainable_vars` as [`Param`]s, under PyTorch's names.

use std::fmt;
use std::sync::Arc;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::module::{Child, ChildMut, Name};
use crate::{Forward, Module, Param};

type TensorFn = dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync;

/// A function of one tensor as a parameterless leaf module: PyTorch's habit of wrapping `F.relu`
/// in a module, for candle.
///
/// Build it from a closure ([`new`](Self::new), [`named`](Self::named)) or from any
/// `candle_core::Module` without weights ([`from_module`](Self::from_module), e.g.
/// `candle_nn::Activation::Gelu`). It has no children; whatever the function captures is invisible
/// to traversal, so a captured weight is neither trained nor saved — wrap layers with weights in
/// [`Native`] instead. Cloning shares the function.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Functional;
///
/// let relu = Functional::new(|x: &Tensor| x.relu());
/// let gelu = Functional::from_module(candle_nn::Activation::Gelu);
/// let x = Tensor::new(&[-1f32, 2.], &Device::Cpu)?;
/// assert_eq!(relu.call(&x)?.to_vec1::<f32>()?, [0., 2.]);
/// assert_eq!(gelu.call(&x)?.dims(), [2]);
/// assert_eq!(relu.num_parameters(), 0);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone)]
pub struct Functional {
    f: Arc<TensorFn>,
    name: &'static str,
}

impl Functional {
    /// Wraps `f`; summaries show it as `Functional`. `f` may return candle's or this crate's error.
    pub fn new<F, E>(f: F) -> Self
    where
        F: Fn(&Tensor) -> std::result::Result<Tensor, E> + Send + Sync + 'static,
        E: Into<Error>,
    {
        Self::named("Functional", f)
    }

    /// Wraps `f` under a type name for summaries and error messages (`"Relu"`).
    pub fn named<F, E>(name: &'static str, f: F) -> Self
    where
        F: Fn(&Tensor) -> std::result::Result<Tensor, E> + Send + Sync + 'static,
        E: Into<Error>,
    {
        Self {
            f: Arc::new(move |x: &Tensor| f(x).map_err(Into::into)),
            name,
        }
    }

    /// Wraps a candle module; summaries show its type name. Any weights it holds stay invisible to
    /// traversal (see [`Native`]).
    pub fn from_module<M: candle_core::Module + Send + Sync + 'static>(module: M) -> Self {
        Self::named(std::any::type_name::<M>(), move |x: &Tensor| {
            module.forward(x)
        })
    }
}

impl fmt::Debug for Functional {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Functional({})", crate::short_type_name(self.name))
    }
}

#[diagnostic::do_not_recommend]
impl Module for Functional {
    fn visit_children<'a>(&'a self, _: &mut dyn FnMut(Name<'_>, Child<'a>)) {}
    fn visit_children_mut<'a>(&'a mut self, _: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {}
    fn type_name(&self) -> &'static str {
        self.name
    }
}

impl Forward<&Tensor> for Functional {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        (self.f)(x)
    }
}

impl Forward<Tensor> for Functional {
    type Output = Tensor;

    fn forward(&self, x: Tensor) -> Result<Tensor> {
        (self.f)(&x)
    }
}

impl candle_core::Module for Functional {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok((self.f)(x)?)
    }
}

/// A candle-nn layer whose weights [`Native`] can expose and swap.
///
/// Implemented for `candle_nn::{Linear, Embedding, LayerNorm, Conv1d, Conv2d}`; implement it for
/// another layer to wrap that one too.
pub trait NativeLayer: candle_core::Module + Send + Sync + 'static {
    /// The layer's weights with their PyTorch names, in a fixed order.
    fn weights(&self) -> Vec<(&'static str, Tensor)>;

    /// The same layer (same configuration) holding `weights`, given in the order of
    /// [`weights`](Self::weights).
    fn with_weights(&self, weights: &[Tensor]) -> Self
    where
        Self: Sized;

    /// The forward pass. `needs_grad` says whether a weight is trained, for layers whose default
    /// forward takes a fused kernel that records no gradient.
    fn forward_native(&self, x: &Tensor, needs_grad: bool) -> candle_core::Result<Tensor> {
        let _ = needs_grad;
        self.forward(x)
    }
}

impl NativeLayer for candle_nn::Linear {
    fn weights(&self) -> Vec<(&'static str, Tensor)> {
        let mut w = vec![("weight", self.weight().clone())];
        w.extend(self.bias().map(|b| ("bias", b.clone())));
        w
    }

    fn with_weights(&self, weights: &[Tensor]) -> Self {
        candle_nn::Linear::new(weights[0].clone(), weights.get(1).cloned())
    }
}

impl NativeLayer for candle_nn::Embedding {
    fn weights(&self) -> Vec<(&'static str, Tensor)> {
        vec![("weight", self.embeddings().clone())]
    }

    fn with_weights(&self, weights: &[Tensor]) -> Self {
        candle_nn::Embedding::new(weights[0].clone(), self.hidden_size())
    }
}

impl NativeLayer for candle_nn::LayerNorm {
    fn weights(&self) -> Vec<(&'static str, Tensor)> {
        let mut w = vec![("weight", self.weight().clone())];
        w.extend(self.bias().map(|b| ("bias", b.clone())));
        w
    }

    fn with_weights(&self, weights: &[Tensor]) -> Self {
        let weight = weights[0].clone();
        match (weights.get(1), self.remove_mean()) {
            (Some(bias), _) => candle_nn::LayerNorm::new(weight, bias.clone(), self.eps()),
            (None, true) => candle_nn::LayerNorm::new_no_bias(weight, self.eps()),
            (None, false) => candle_nn::LayerNorm::rms_norm(weight, self.eps()),
        }
    }

    /// candle-nn's `LayerNorm` takes a fused kernel without backward for contiguous inputs with a
    /// bias (candle #2168); when a weight is trained, take candle-nn's composed version instead.
    fn forward_native(&self, x: &Tensor, needs_grad: bool) -> candle_core::Result<Tensor> {
        match (needs_grad, self.bias()) {
            (true, Some(bias)) if self.remove_mean() => {
                candle_nn::ops::layer_norm_slow(x, self.weight(), bias, self.eps() as f32)
            }
            _ => candle_core::Module::forward(self, x),
        }
    }
}

/// candle-nn's convolutions: `weight` and an optional `bias`, rebuilt with the same config.
macro_rules! native_conv {
    ($($ty:ident),*) => {$(
        impl NativeLayer for candle_nn::$ty {
            fn weights(&self) -> Vec<(&'static str, Tensor)> {
                let mut w = vec![("weight", self.weight().clone())];
                w.extend(self.bias().map(|b| ("bias", b.clone())));
                w
            }

            fn with_weights(&self, weights: &[Tensor]) -> Self {
                candle_nn::$ty::new(weights[0].clone(), weights.get(1).cloned(), *self.config())
            }
        }
    )*};
}
native_conv!(Conv1d, Conv2d);

/// A candle-nn layer as a module whose weights are [`Param`]s: they are listed by traversal (under
/// PyTorch's names, `weight` and `bias`), saved and loaded, frozen, moved, and handed to optimizers
/// by `trainable_vars`.
///
/// **How.** [`new`](Self::new) makes each weight a `Param`. A weight that is already a candle
/// `Var` (a layer built through a `VarMap`/`VarBuilder`) is wrapped without a copy, so the
/// `VarMap`, the layer and the `Param` share one storage and one autograd identity; a plain tensor
/// is copied into a fresh `Var`. Each forward rebuilds the candle layer from the *current*
/// parameter tensors (a few reference-count bumps), so a frozen weight is read detached, and
/// [`to_device`](crate::ModuleExt::to_device), `to_dtype` and loads are seen by the next call.
///
/// **Limits.** The layer's configuration is fixed at wrapping time (shapes must not change). After
/// a device or dtype move, the `Param` holds a new `Var`: a `VarMap` the layer came from still holds
/// the old one (PyTorch's rule applies: build optimizers after moving). Only the layers implementing
/// [`NativeLayer`] can be wrapped; for any other candle module, [`Functional::from_module`] runs it
/// with its weights invisible. candle-nn's `LayerNorm` is run through its composed (differentiable)
/// path whenever a weight is trained, since its fused kernel records no gradient.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Native;
/// use candle_nn::{Optimizer, VarBuilder, VarMap};
///
/// let dev = Device::Cpu;
/// let varmap = VarMap::new();
/// let vb = VarBuilder::from_varmap(&varmap, DType::F32, &dev);
/// let fc = Native::new(candle_nn::linear(4, 2, vb.pp("fc"))?)?;
/// let names: Vec<String> = fc.named_parameters().into_iter().map(|(n, _)| n).collect();
/// assert_eq!(names, ["weight", "bias"]);
///
/// let mut sgd = candle_nn::SGD::new(fc.trainable_vars()?, 0.1)?;
/// let before = fc.get_parameter("weight")?.tensor()?.sum_all()?.to_scalar::<f32>()?;
/// let loss = fc.call(&Tensor::ones((3, 4), DType::F32, &dev)?)?.sum_all()?;
/// sgd.backward_step(&loss)?;
/// let after = fc.get_parameter("weight")?.tensor()?.sum_all()?.to_scalar::<f32>()?;
/// assert!(after < before);
/// // The VarMap sees the update too: one storage.
/// let in_varmap = varmap.data().lock().unwrap()["fc.weight"].sum_all()?.to_scalar::<f32>()?;
/// assert_eq!(in_varmap, after);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub struct Native<L> {
    layer: L,
    params: Vec<(&'static str, Param)>,
}

impl<L: NativeLayer> Native<L> {
    /// Wraps `layer`, making its weights parameters (shared with `layer` when they are `Var`s).
    pub fn new(layer: L) -> Result<Self> {
        let params = layer
            .weights()
            .into_iter()
            .map(|(name, t)| Ok((name, Param::new(t)?)))
            .collect::<Result<Vec<_>>>()?;
        let tensors: Vec<Tensor> = params
            .iter()
            .map(|(_, p)| Ok(p.current_var()?.as_tensor().clone()))
            .collect::<Result<_>>()?;
        Ok(Self {
            layer: layer.with_weights(&tensors),
            params,
        })
    }

    /// The candle-nn layer, holding the current parameter values.
    pub fn layer(&self) -> Result<L> {
        Ok(self.layer.with_weights(&self.current()?))
    }

    /// The parameter tensors as a forward pass reads them.
    fn current(&self) -> Result<Vec<Tensor>> {
        self.params.iter().map(|(_, p)| p.current()).collect()
    }
}

impl<L: NativeLayer + Clone> Clone for Native<L> {
    /// The same layer: the clone's parameters are the same parameters (as for every module).
    fn clone(&self) -> Self {
        Self {
            layer: self.layer.clone(),
            params: self.params.clone(),
        }
    }
}

impl<L: NativeLayer> fmt::Debug for Native<L> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct(&crate::short_type_name(std::any::type_name::<Self>()));
        for (name, p) in &self.params {
            s.field(name, p);
        }
        s.finish()
    }
}

#[diagnostic::do_not_recommend]
impl<L: NativeLayer> Module for Native<L> {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        for (name, p) in &self.params {
            f(Name::Field(name), Child::Param(p));
        }
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        for (name, p) in self.params.iter_mut() {
            f(Name::Field(name), ChildMut::Param(p));
        }
    }
}

impl<L: NativeLayer> Forward<&Tensor> for Native<L> {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let needs_grad =
            crate::is_grad_enabled() && self.params.iter().any(|(_, p)| p.requires_grad());
        Ok(self.layer()?.forward_native(x, needs_grad)?)
    }
}

impl<L: NativeLayer> Forward<Tensor> for Native<L> {
    type Output = Tensor;

    fn forward(&self, x: Tensor) -> Result<Tensor> {
        self.forward(&x)
    }
}

impl<L: NativeLayer> candle_core::Module for Native<L> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(Forward::forward(self, x)?)
    }
}
