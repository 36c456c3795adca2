//! Parametrizations, PyTorch's `torch.nn.utils.parametrize` and
//! `torch.nn.utils.parametrizations`: a layer's weight (or bias) computed on every forward from
//! other tensors, its *originals*: [`weight_norm`], [`spectral_norm`], [`orthogonal`], and any
//! [`Parametrization`] of your own ([`register_parametrization`]), registered by path.
//!
//! # Design: the layer keeps a stand-in, the originals take PyTorch's keys
//!
//! PyTorch moves `module.weight` into `module.parametrizations.weight.original` (or
//! `original0`, `original1`, …) and makes `module.weight` a property computed from them. A Rust
//! layer's `weight` field cannot disappear, so it keeps a *stand-in*
//! ([`Param::parametrized_stand_in`]): a parameter every walk skips and that refuses to be read
//! or written. The layer's own (flattened) slot holds the rest, so paths, state dicts, optimizers
//! and `print(model)` see what PyTorch's do:
//!
//! - `<layer>.parametrizations.weight.original0`/`original1` (weight norm's `g` and `v`),
//!   `<layer>.parametrizations.weight.original` (spectral norm, orthogonal, yours), and the
//!   parametrization's own state, `<layer>.parametrizations.weight.0._u`/`._v` (spectral norm),
//!   `.0.base` (orthogonal): a PyTorch state dict of the parametrized model loads strictly, and
//!   ours loads in PyTorch;
//! - the layer's forward computes the weight from the originals on every call (gradients flow to
//!   them), or once per [`cached`] scope; [`parametrized_tensor`] reads it as PyTorch's
//!   `module.weight` does;
//! - `print(model)` shows `ParametrizedLinear(` with its `(parametrizations): ModuleDict(...)`.
//!
//! The layers that take parametrizations are `Linear`, `Conv1d/2d/3d` and `ConvTranspose1d/2d`
//! (their `weight` and `bias`) and `Embedding` (its `weight`), also in a built `Lazy` cell and as `LazyLinear`, `LazyConv1d/2d`
//! once built; another module at the path is
//! [`ParametrizeError::UnsupportedModule`]. Every error names the tensor's path and leaves the
//! model as it was.
//!
//! # Checkpoints of the older functions
//!
//! `torch.nn.utils.weight_norm` (`weight_g`, `weight_v`) and `torch.nn.utils.spectral_norm`
//! (`weight_orig`, `weight_u`, `weight_v`) saved other keys. [`legacy_keys`] gives the rules
//! that rename them onto a parametrized model's keys (from what the model holds, so a weight
//! norm's `weight_v` and a spectral norm's go where they belong); add them to the load options.
//!
//! Not implemented: parametrizing a layer that holds LoRA adapters (or adding adapters to a
//! parametrized one), a quantized or unbuilt weight, PyTorch's `unsafe=True` (a
//! parametrization must keep the tensor's shape and dtype), and hooks on the parametrization
//! modules (they are computed from, not `call`ed: a hook on `fc.parametrizations.weight.0` does
//! not fire).
//!
//! ```
//! use module_runtime::prelude::*;
//! use module_runtime::nn::parametrize::{remove_parametrizations, weight_norm};
//!
//! let mut fc = Linear::new(20, 40, &Device::Cpu)?;
//! weight_norm(&mut fc, "weight", Some(0))?;
//! assert_eq!(
//!     fc.to_string(),
//!     "ParametrizedLinear(
//!   in_features=20, out_features=40, bias=True
//!   (parametrizations): ModuleDict(
//!     (weight): ParametrizationList(
//!       (0): _WeightNorm()
//!     )
//!   )
//! )"
//! );
//! let names: Vec<String> = fc.named_parameters().into_iter().map(|(n, _)| n).collect();
//! assert_eq!(names, ["bias", "parametrizations.weight.original0", "parametrizations.weight.original1"]);
//! remove_parametrizations(&mut fc, "weight", true)?;
//! assert_eq!(fc.to_string(), "Linear(in_features=20, out_features=40, bias=True)");
//! # Ok::<(), module_runtime::Error>(())
//! ```

mod list;
mod norms;
mod orthogonal;

use candle_core::Tensor;

pub use list::{
    cached, Parametrization, ParametrizationClone, ParametrizationList, Parametrizations,
};
pub(crate) use list::{optional_value_of, value_of};
pub use norms::{spectral_norm, weight_norm, SpectralNorm, SpectralNormOptions, WeightNorm};
pub use orthogonal::{orthogonal, Orthogonal, OrthogonalMap};

use crate::conv::{Conv, ConvTranspose, LazyConv};
use crate::embedding::Embedding;
use crate::error::Result;
use crate::linear::{LazyLinear, Linear};
use crate::{Lazy, Module, ModuleExt, Param};
use module_core::KeyRule;
use module_core::ParametrizeError;

/// A layer that takes parametrizations: its tensors by name and its slot.
pub(crate) trait Host: Module {
    /// The parameter `name` (`weight`, `bias`), if the layer has it.
    fn tensor(&self, name: &str) -> Option<&Param>;
    fn tensor_mut(&mut self, name: &str) -> Option<&mut Param>;
    /// The names of the layer's parameters.
    fn tensor_names(&self) -> Vec<&'static str>;
    fn slot(&self) -> &Option<Box<Parametrizations>>;
    fn slot_mut(&mut self) -> &mut Option<Box<Parametrizations>>;
    /// Whether the layer holds LoRA adapters.
    fn has_adapter(&self) -> bool {
        false
    }
    /// Whether it is a transposed convolution (spectral norm's default `dim` is 1).
    fn transposed(&self) -> bool {
        false
    }
}

macro_rules! host {
    ($ty:ty, weight only; $adapter:expr) => {
        impl Host for $ty {
            fn tensor(&self, name: &str) -> Option<&Param> {
                (name == "weight").then_some(&self.weight)
            }
            fn tensor_mut(&mut self, name: &str) -> Option<&mut Param> {
                (name == "weight").then_some(&mut self.weight)
            }
            fn tensor_names(&self) -> Vec<&'static str> {
                vec!["weight"]
            }
            fn slot(&self) -> &Option<Box<Parametrizations>> {
                &self.parametrizations
            }
            fn slot_mut(&mut self) -> &mut Option<Box<Parametrizations>> {
                &mut self.parametrizations
            }
            fn has_adapter(&self) -> bool {
                let adapter: fn(&Self) -> bool = $adapter;
                adapter(self)
            }
        }

        impl $ty {
            /// The weight as the forward computes with it (parametrized or not).
            pub(crate) fn weight_value(&self) -> Result<Tensor> {
                value_of(&self.weight, "weight", &self.parametrizations)
            }
        }
    };
    ($ty:ty $(, $generic:ident)? ; $transposed:expr, $adapter:expr) => {
        impl$(<const $generic: usize>)? Host for $ty {
            fn tensor(&self, name: &str) -> Option<&Param> {
                match name {
                    "weight" => Some(&self.weight),
                    "bias" => self.bias.as_ref(),
                    _ => None,
                }
            }
            fn tensor_mut(&mut self, name: &str) -> Option<&mut Param> {
                match name {
                    "weight" => Some(&mut self.weight),
                    "bias" => self.bias.as_mut(),
                    _ => None,
                }
            }
            fn tensor_names(&self) -> Vec<&'static str> {
                let mut names = vec!["weight"];
                if self.bias.is_some() {
                    names.push("bias");
                }
                names
            }
            fn slot(&self) -> &Option<Box<Parametrizations>> {
                &self.parametrizations
            }
            fn slot_mut(&mut self) -> &mut Option<Box<Parametrizations>> {
                &mut self.parametrizations
            }
            fn has_adapter(&self) -> bool {
                let adapter: fn(&Self) -> bool = $adapter;
                adapter(self)
            }
            fn transposed(&self) -> bool {
                $transposed
            }
        }

        impl$(<const $generic: usize>)? $ty {
            /// The weight as the forward computes with it (parametrized or not).
            pub(crate) fn weight_value(&self) -> Result<Tensor> {
                value_of(&self.weight, "weight", &self.parametrizations)
            }

            /// The bias as the forward computes with it, if the layer has one.
            pub(crate) fn bias_value(&self) -> Result<Option<Tensor>> {
                optional_value_of(&self.bias, "bias", &self.parametrizations)
            }
        }
    };
}
host!(Linear; false, |l| l.lora.is_some());
host!(Embedding, weight only; |e| e.lora.is_some());
host!(Conv<D>, D; false, |c| c.lora.is_some());
host!(ConvTranspose<D>, D; true, |_| false);

/// Calls `$m!` with every layer type that takes parametrizations, and the lazy forms holding
/// one: a built `Lazy<L>` cell, `LazyLinear`, `LazyConv1d/2d` (their paths are the layer's).
macro_rules! for_hosts {
    ($m:ident) => {
        $m!(Linear, Conv<1>, Conv<2>, Conv<3>, ConvTranspose<1>, ConvTranspose<2>, Embedding);
        $m!(@lazy Linear, Conv<1>, Conv<2>, Conv<3>, ConvTranspose<1>, ConvTranspose<2>);
        $m!(@field LazyLinear => linear, LazyConv<1> => conv, LazyConv<2> => conv);
    };
}

/// `m` as a layer that takes parametrizations, if it is one.
fn as_host(m: &dyn Module) -> Option<&dyn Host> {
    macro_rules! try_as {
        (@lazy $($ty:ty),*) => {$(
            if let Some(h) = m.downcast_ref::<Lazy<$ty>>().and_then(Lazy::get) {
                return Some(h);
            }
        )*};
        (@field $($ty:ty => $field:ident),*) => {$(
            if let Some(h) = m.downcast_ref::<$ty>() {
                return Some(&h.$field);
            }
        )*};
        ($($ty:ty),*) => {$(
            if let Some(h) = m.downcast_ref::<$ty>() {
                return Some(h);
            }
        )*};
    }
    for_hosts!(try_as);
    None
}

/// [`as_host`], mutably.
fn as_host_mut(m: &mut dyn Module) -> Option<&mut dyn Host> {
    macro_rules! try_as {
        (@lazy $($ty:ty),*) => {$(
            if m.is::<Lazy<$ty>>() {
                let cell = m.downcast_mut::<Lazy<$ty>>()?;
                return cell.get_mut().map(|h| h as &mut dyn Host);
            }
        )*};
        (@field $($ty:ty => $field:ident),*) => {$(
            if m.is::<$ty>() {
                return m.downcast_mut::<$ty>().map(|h| &mut h.$field as &mut dyn Host);
            }
        )*};
        ($($ty:ty),*) => {$(
            if m.is::<$ty>() {
                return m.downcast_mut::<$ty>().map(|h| h as &mut dyn Host);
            }
        )*};
    }
    for_hosts!(try_as);
    None
}

/// `conv1.weight` as the layer's path (`conv1`) and the tensor's name (`weight`).
pub(crate) fn split_path(path: &str) -> (&str, &str) {
    path.rsplit_once('.').unwrap_or(("", path))
}

fn unsupported(m: &dyn Module, layer: &str) -> ParametrizeError {
    if m.__unbuilt() {
        return invalid(layer, "the layer is not built yet: build or load it first");
    }
    ParametrizeError::UnsupportedModule {
        path: layer.to_owned(),
        found: m.class_name(),
    }
}

/// The layer at `layer` (in `root`), as a host.
pub(crate) fn host_ref<'a>(root: &'a dyn Module, layer: &str) -> Result<&'a dyn Host> {
    let m = module_core::path::submodule(root, layer)?;
    as_host(m).ok_or_else(|| unsupported(m, layer).into())
}

fn no_tensor(host: &dyn Host, path: &str) -> ParametrizeError {
    ParametrizeError::NoTensor {
        path: path.to_owned(),
        module: host.class_name(),
        available: host.tensor_names().iter().map(|s| s.to_string()).collect(),
    }
}

fn invalid(path: &str, message: impl Into<String>) -> ParametrizeError {
    ParametrizeError::Invalid {
        path: path.to_owned(),
        message: message.into(),
    }
}

/// `e` naming `path` where a parametrization's own error could not (it does not know its path).
fn at_path(e: module_core::Error, path: &str) -> module_core::Error {
    match e {
        module_core::Error::Parametrize(ParametrizeError::Invalid { path: p, message })
            if p.is_empty() =>
        {
            invalid(path, message).into()
        }
        e => e,
    }
}

/// The tensors of `host` that are parametrized.
fn parametrized_names(host: &dyn Host) -> Vec<String> {
    host.slot()
        .as_ref()
        .map(|s| s.parametrizations.keys().map(str::to_owned).collect())
        .unwrap_or_default()
}

/// Registers `parametrization` on the tensor at `path` (`"fc.weight"`; `"weight"` for the model
/// itself): PyTorch's `register_parametrization(module, name, parametrization)`.
///
/// The first parametrization of a tensor takes the originals its
/// [`right_inverse`](Parametrization::right_inverse) makes of the tensor's value: one is the
/// tensor's own parameter (set to that value: an optimizer holding it keeps training it, as in
/// PyTorch), at `<layer>.parametrizations.<name>.original`; several are new parameters
/// `original0`, `original1`, … (trained if the tensor was). A later one is chained after the
/// others. The parametrization takes the layer's training mode, and must give back a tensor of the
/// tensor's shape and dtype (checked once, here).
///
/// Errors, each naming `path`, with the model unchanged: [`ParametrizeError::UnsupportedModule`],
/// [`ParametrizeError::NoTensor`], [`ParametrizeError::Invalid`] (a quantized or unbuilt
/// tensor, a layer with adapters, a shape or dtype the parametrization changes).
pub fn register_parametrization<M, P>(model: &mut M, path: &str, parametrization: P) -> Result<()>
where
    M: ModuleExt + ?Sized,
    P: Parametrization,
{
    let (layer, name) = split_path(path);
    let training = module_core::path::submodule(model.as_dyn(), layer)?.is_training();
    let m = model.get_submodule_dyn_mut(layer)?;
    let refused = unsupported(m, layer);
    let host = as_host_mut(m).ok_or(refused)?;
    if host.has_adapter() {
        return Err(invalid(
            path,
            "the layer holds LoRA adapters: parametrizing an adapted layer is not supported",
        )
        .into());
    }
    let param = host
        .tensor(name)
        .ok_or_else(|| no_tensor(host, path))?
        .clone();
    let (shape, dtype) = (param.shape(), param.dtype());
    parametrization.set_training(training);
    let p: Box<dyn Parametrization> = Box::new(parametrization);
    let check = |t: &Tensor, what: &str| -> Result<()> {
        if t.shape() != &shape || t.dtype() != dtype {
            return Err(invalid(
                path,
                format!(
                    "the parametrization makes {what} of shape {:?} and dtype {:?} from a tensor of \
                     shape {:?} and dtype {dtype:?}: it must keep both",
                    t.dims(),
                    t.dtype(),
                    shape.dims()
                ),
            )
            .into());
        }
        Ok(())
    };
    let _no_grad = module_core::no_grad();
    if param.is_parametrized() {
        // Chained after the others: checked on the current value.
        let list = host
            .slot()
            .as_ref()
            .and_then(|s| s.list(name))
            .ok_or_else(|| no_tensor(host, path))?;
        let current = list.compute()?;
        let z = p.forward(std::slice::from_ref(&current));
        check(&z.map_err(|e| at_path(e, path))?, "a tensor")?;
        let slot = host
            .slot_mut()
            .as_mut()
            .expect("a parametrized layer's slot");
        let list = slot.parametrizations.get_mut(name).expect("its list");
        list.chain.push(p);
        return Ok(());
    }
    if param.is_quantized() {
        return Err(invalid(path, "a quantized weight cannot be parametrized").into());
    }
    if !param.is_built() {
        return Err(invalid(
            path,
            "an unbuilt (lazy) tensor cannot be parametrized: build or load it first",
        )
        .into());
    }
    let value = param.tensor()?;
    let originals = p.right_inverse(&value).map_err(|e| at_path(e, path))?;
    if originals.is_empty() {
        return Err(invalid(path, "`right_inverse` returned no tensor").into());
    }
    check(
        &p.forward(&originals).map_err(|e| at_path(e, path))?,
        "a tensor",
    )?;
    let requires_grad = param.requires_grad();
    let originals: Vec<Param> = if let [one] = &originals[..] {
        check(one, "an original")?;
        param.set(one)?;
        vec![param.clone()]
    } else {
        originals
            .iter()
            .map(|t| {
                let p = Param::new(t.detach())?;
                p.set_requires_grad(requires_grad);
                Ok(p)
            })
            .collect::<Result<_>>()?
    };
    // The stand-in shares the storage of an original of the tensor's shape (no copy kept).
    let like = originals
        .iter()
        .find(|o| o.shape() == shape)
        .unwrap_or(&param);
    let stand_in = Param::parametrized_stand_in(like);
    let list = ParametrizationList {
        originals,
        chain: vec![p],
        like: (shape.dims().to_vec(), dtype),
    };
    let slot = host.slot_mut().get_or_insert_with(Default::default);
    slot.parametrizations.insert(name, list)?;
    *host.tensor_mut(name).expect("checked above") = stand_in;
    Ok(())
}

/// Removes the parametrizations of the tensor at `path`: PyTorch's
/// `remove_parametrizations(module, name, leave_parametrized)`. With `leave_parametrized`, the
/// layer's tensor becomes a plain parameter holding the parametrized value (computed once more:
/// a spectral norm in training mode takes one more power iteration, as in PyTorch); a single
/// original is that parameter (set to the value), several give way to a new one. Without it, the
/// single original becomes the tensor again, unchanged (several are
/// [`ParametrizeError::Invalid`]).
///
/// [`ParametrizeError::NotParametrized`] when the tensor has no parametrization; the model is
/// unchanged on every error.
pub fn remove_parametrizations<M: ModuleExt + ?Sized>(
    model: &mut M,
    path: &str,
    leave_parametrized: bool,
) -> Result<()> {
    let (layer, name) = split_path(path);
    let m = model.get_submodule_dyn_mut(layer)?;
    let refused = unsupported(m, layer);
    let host = as_host_mut(m).ok_or(refused)?;
    let Some(list) = host.slot().as_ref().and_then(|s| s.list(name)) else {
        if host.tensor(name).is_none() {
            return Err(no_tensor(host, path).into());
        }
        return Err(ParametrizeError::NotParametrized {
            path: path.to_owned(),
            parametrized: parametrized_names(host),
        }
        .into());
    };
    let weight =
        match (&list.originals[..], leave_parametrized) {
            ([one], true) => {
                let value = module_core::without_grad(|| list.compute())?;
                one.set(&value)?;
                one.clone()
            }
            ([one], false) => one.clone(),
            (several, true) => {
                let value = module_core::without_grad(|| list.compute())?;
                let p = Param::new(value)?;
                p.set_requires_grad(several.iter().any(Param::requires_grad));
                p
            }
            (_, false) => return Err(invalid(
                path,
                "cannot leave unparametrized (`leave_parametrized=false`) a tensor parametrized \
                 by several originals",
            )
            .into()),
        };
    let slot = host.slot_mut();
    if let Some(s) = slot.as_mut() {
        s.parametrizations.remove(name);
        if s.parametrizations.is_empty() {
            *slot = None;
        }
    }
    *host.tensor_mut(name).expect("a parametrized tensor") = weight;
    Ok(())
}

/// Whether the tensor at `path` is parametrized (PyTorch's `is_parametrized(module, name)`);
/// `false` for a path that names no such tensor.
pub fn is_parametrized<M: ModuleExt + ?Sized>(model: &M, path: &str) -> bool {
    let (layer, name) = split_path(path);
    let Ok(m) = module_core::path::submodule(model.as_dyn(), layer) else {
        return false;
    };
    as_host(m).is_some_and(|h| h.slot().as_ref().is_some_and(|s| s.list(name).is_some()))
}

/// The tensor at `path` as the layer computes with it, PyTorch's `module.weight`: the
/// parametrized value (computed now, gradients flowing to the originals) when it is parametrized,
/// the parameter's own value otherwise.
pub fn parametrized_tensor<M: ModuleExt + ?Sized>(model: &M, path: &str) -> Result<Tensor> {
    let (layer, name) = split_path(path);
    let host = host_ref(model.as_dyn(), layer)?;
    let param = host.tensor(name).ok_or_else(|| no_tensor(host, path))?;
    value_of(param, name, host.slot())
}

/// The key rules that load a checkpoint of PyTorch's older functions into `model`'s
/// parametrizations: for each tensor `<layer>.<name>` parametrized by weight norm,
/// `<layer>.<name>_g` → `…parametrizations.<name>.original0` and `<layer>.<name>_v` →
/// `…original1` (`torch.nn.utils.weight_norm`'s keys); by spectral norm, `<layer>.<name>_orig` →
/// `…parametrizations.<name>.original`, `<layer>.<name>_u` → `….0._u` and `<layer>.<name>_v` →
/// `….0._v` (`torch.nn.utils.spectral_norm`'s). Give them to the load options
/// ([`LoadOptions::rule`](module_state::LoadOptions::rule)); keys already in the new form are left alone,
/// so one set of options loads both.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::parametrize::{legacy_keys, weight_norm};
/// use module_runtime::{LoadOptions, StateDict};
///
/// let mut fc = Linear::new(3, 2, &Device::Cpu)?;
/// weight_norm(&mut fc, "weight", Some(0))?;
/// // What `torch.nn.utils.weight_norm(nn.Linear(3, 2))` saves.
/// let mut legacy = StateDict::new();
/// legacy.insert("weight_g", Tensor::ones((2, 1), DType::F32, &Device::Cpu)?);
/// legacy.insert("weight_v", Tensor::ones((2, 3), DType::F32, &Device::Cpu)?);
/// legacy.insert("bias", Tensor::zeros(2, DType::F32, &Device::Cpu)?);
/// let options = legacy_keys(&fc).into_iter().fold(LoadOptions::default(), LoadOptions::rule);
/// fc.load_state_dict(&legacy, &options)?;
/// assert_eq!(fc.get_parameter("parametrizations.weight.original1")?.tensor()?.sum_all()?.to_scalar::<f32>()?, 6.0);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn legacy_keys<M: ModuleExt + ?Sized>(model: &M) -> Vec<KeyRule> {
    let mut rules = Vec::new();
    for (path, m) in model.as_dyn().named_modules() {
        let Some(host) = as_host(m) else { continue };
        let Some(slot) = host.slot() else { continue };
        let at = |key: &str| match path.as_str() {
            "" => key.to_owned(),
            p => format!("{p}.{key}"),
        };
        for (name, list) in slot.parametrizations.iter() {
            let Some(first) = list.chain.first() else {
                continue;
            };
            let first: &dyn Module = &**first;
            let new = |rest: &str| at(&format!("parametrizations.{name}.{rest}"));
            let mut rename = |old: &str, rest: &str| {
                rules.push(KeyRule::RenameKey(at(&format!("{name}{old}")), new(rest)));
            };
            if first.is::<WeightNorm>() && list.originals.len() == 2 {
                rename("_g", "original0");
                rename("_v", "original1");
            } else if first.is::<SpectralNorm>() && list.originals.len() == 1 {
                rename("_orig", "original");
                rename("_u", "0._u");
                rename("_v", "0._v");
            }
        }
    }
    rules
}
