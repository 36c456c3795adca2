//! The parametrizations of one layer: [`Parametrization`] (what a parametrization computes),
//! [`ParametrizationList`] (PyTorch's: a tensor's originals and the chain of parametrizations
//! computing it from them), the layer's slot (`parametrizations`, a `ModuleDict` of lists by
//! tensor name), and the [`cached`] scope.

use std::cell::RefCell;
use std::collections::HashMap;

use candle_core::{DType, Tensor};

use crate::container::ModuleDict;
use crate::error::Result;
use crate::module::{Child, ChildMut, Name};
use crate::{Module, Param};
use module_core::ParametrizeError;

/// A parametrization: a module that computes a tensor of a layer from its originals (PyTorch's
/// parametrization modules, registered with
/// [`register_parametrization`](super::register_parametrization)).
///
/// The first parametrization of a tensor gets every original (as many as its
/// [`right_inverse`](Self::right_inverse) returns); each later one in the chain gets the previous
/// one's output. Its own parameters and buffers are saved under
/// `<layer>.parametrizations.<tensor>.<i>.` (spectral norm's `_u`, `_v`), and a [`Mode`](crate::Mode)
/// field follows the model's `train`/`eval`.
///
/// A parametrization is `Clone` (a layer is): derive it with the module.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::parametrize::{register_parametrization, parametrized_tensor, Parametrization};
///
/// /// PyTorch's tutorial example: a symmetric weight from its upper triangle.
/// #[derive(Module, Clone, Debug)]
/// struct Symmetric;
///
/// impl Parametrization for Symmetric {
///     fn forward(&self, originals: &[Tensor]) -> Result<Tensor> {
///         let x = &originals[0];
///         let n = x.dim(0)?;
///         let upper = Tensor::tril2(n, x.dtype(), x.device())?.t()?; // ones on and above the diagonal
///         let triu = (x * &upper)?;
///         let strict = (&triu - (x * Tensor::eye(n, x.dtype(), x.device())?)?)?;
///         Ok((triu + strict.t()?)?)
///     }
/// }
///
/// let mut fc = Linear::new(3, 3, &Device::Cpu)?;
/// register_parametrization(&mut fc, "weight", Symmetric)?;
/// let w = parametrized_tensor(&fc, "weight")?;
/// assert_eq!(w.to_vec2::<f32>()?, w.t()?.to_vec2::<f32>()?);
/// assert!(fc.get_parameter("parametrizations.weight.original").is_ok());
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub trait Parametrization: Module + std::fmt::Debug + ParametrizationClone {
    /// The parametrized tensor from `originals`: all of the tensor's originals for the first
    /// parametrization of a chain, the previous output for a later one.
    fn forward(&self, originals: &[Tensor]) -> Result<Tensor>;

    /// The originals that [`forward`](Self::forward) turns into `value`: PyTorch's
    /// `right_inverse`, called once on the layer's tensor when the parametrization is the first
    /// one registered on it. The default is `value` itself (one original, PyTorch's default).
    fn right_inverse(&self, value: &Tensor) -> Result<Vec<Tensor>> {
        Ok(vec![value.clone()])
    }
}

/// The copy a layer's `Clone` makes of its parametrizations: implemented for every
/// [`Parametrization`] that is `Clone`.
pub trait ParametrizationClone {
    /// A boxed copy (parameters and buffers shared, as a layer's clone shares them).
    fn box_clone(&self) -> Box<dyn Parametrization>;
}

impl<T: Parametrization + Clone> ParametrizationClone for T {
    fn box_clone(&self) -> Box<dyn Parametrization> {
        Box::new(self.clone())
    }
}

/// A parametrized tensor's originals and the parametrizations computing it from them: PyTorch's
/// `ParametrizationList`, at `<layer>.parametrizations.<tensor>`.
///
/// Its children are the originals, `original` (one) or `original0`, `original1`, … (several, as
/// weight norm's `g` and `v`), then each parametrization by position (`0`, `1`, …).
#[derive(Debug)]
pub struct ParametrizationList {
    pub(crate) originals: Vec<Param>,
    pub(crate) chain: Vec<Box<dyn Parametrization>>,
    /// The parametrized tensor's shape and dtype (every parametrization keeps them).
    pub(crate) like: (Vec<usize>, DType),
}

impl Clone for ParametrizationList {
    fn clone(&self) -> Self {
        Self {
            originals: self.originals.clone(),
            chain: self.chain.iter().map(|p| p.box_clone()).collect(),
            like: self.like.clone(),
        }
    }
}

impl ParametrizationList {
    /// The originals' names: `original`, or `original0`, `original1`, ….
    pub(crate) fn original_names(&self) -> Vec<String> {
        match self.originals.len() {
            1 => vec!["original".to_owned()],
            n => (0..n).map(|i| format!("original{i}")).collect(),
        }
    }

    /// The originals: one, or several (weight norm's `g` then `v`).
    pub fn originals(&self) -> &[Param] {
        &self.originals
    }

    /// The parametrizations, in the order they were registered.
    pub fn parametrizations(&self) -> impl Iterator<Item = &dyn Parametrization> {
        self.chain.iter().map(|p| &**p)
    }

    /// The parametrized tensor, computed from the originals (gradients flow to them), or the one
    /// computed earlier in the same [`cached`] scope.
    pub fn compute(&self) -> Result<Tensor> {
        let key = self as *const Self as usize;
        if let Some(t) = CACHE.with(|c| c.borrow().as_ref().and_then(|m| m.get(&key).cloned())) {
            return Ok(t);
        }
        let originals = self
            .originals
            .iter()
            .map(Param::tensor)
            .collect::<Result<Vec<_>>>()?;
        let t = self.chain_from(&originals)?;
        CACHE.with(|c| {
            if let Some(m) = c.borrow_mut().as_mut() {
                m.insert(key, t.clone());
            }
        });
        Ok(t)
    }

    /// Sets the originals so that the list computes `value`: PyTorch's
    /// `ParametrizationList.right_inverse(value)`, what `module.weight = value` does on a
    /// parametrized module. Each parametrization's [`right_inverse`](Parametrization::right_inverse)
    /// runs, the last registered first (a later one must give one tensor); the originals are set
    /// in place (an optimizer holding them keeps training them), all or none: a value or result of
    /// another shape or dtype is [`ParametrizeError::Invalid`] and changes nothing.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::parametrize::{parametrized_tensor, weight_norm, ParametrizationList};
    ///
    /// let mut fc = Linear::new(3, 2, &Device::Cpu)?;
    /// weight_norm(&mut fc, "weight", Some(0))?;
    /// // A plain checkpoint's weight, into the weight-normed layer.
    /// let w = Tensor::new(&[[1f32, 2., 2.], [0., 3., 4.]], &Device::Cpu)?;
    /// fc.get_submodule::<ParametrizationList>("parametrizations.weight")?.right_inverse(&w)?;
    /// let g = fc.get_parameter("parametrizations.weight.original0")?.tensor()?;
    /// assert_eq!(g.flatten_all()?.to_vec1::<f32>()?, [3., 5.]);
    /// let got = parametrized_tensor(&fc, "weight")?;
    /// assert!((got - w)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn right_inverse(&self, value: &Tensor) -> Result<()> {
        let invalid = |message: String| ParametrizeError::Invalid {
            path: String::new(),
            message,
        };
        let (dims, dtype) = &self.like;
        if value.dims() != dims || value.dtype() != *dtype {
            return Err(invalid(format!(
                "a value of shape {:?} and dtype {:?} for a tensor of shape {dims:?} and dtype \
                 {dtype:?}",
                value.dims(),
                value.dtype()
            ))
            .into());
        }
        let values = module_core::without_grad(|| -> Result<Vec<Tensor>> {
            let mut values = vec![value.detach()];
            for (i, p) in self.chain.iter().enumerate().rev() {
                let one = match &values[..] {
                    [one] => one.clone(),
                    many => {
                        return Err(invalid(format!(
                            "parametrization {} gave {} tensors to the one before it, which takes \
                             one",
                            i + 1,
                            many.len()
                        ))
                        .into())
                    }
                };
                values = p.right_inverse(&one)?;
            }
            Ok(values)
        })?;
        if values.len() != self.originals.len() {
            return Err(invalid(format!(
                "`right_inverse` gave {} tensors for {} originals",
                values.len(),
                self.originals.len()
            ))
            .into());
        }
        let names = self.original_names();
        for ((v, o), name) in values.iter().zip(&self.originals).zip(&names) {
            if v.shape() != &o.shape() || v.dtype() != o.dtype() {
                return Err(invalid(format!(
                    "`right_inverse` gave {name} of shape {:?} and dtype {:?}; it is {:?}, {:?}",
                    v.dims(),
                    v.dtype(),
                    o.shape().dims(),
                    o.dtype()
                ))
                .into());
            }
        }
        for (v, o) in values.iter().zip(&self.originals) {
            o.set(v)?;
        }
        Ok(())
    }

    /// The chain run on `originals`.
    pub(crate) fn chain_from(&self, originals: &[Tensor]) -> Result<Tensor> {
        let mut chain = self.chain.iter();
        let first = chain.next().ok_or_else(|| ParametrizeError::Invalid {
            path: String::new(),
            message: "an empty parametrization list".into(),
        })?;
        let mut x = first.forward(originals)?;
        for p in chain {
            x = p.forward(std::slice::from_ref(&x))?;
        }
        Ok(x)
    }
}

/// A node with no typed path methods: its children's names are built at run time.
impl crate::typed_path::HasPath for ParametrizationList {
    type Path<R: 'static, K: crate::typed_path::PathKind> = crate::typed_path::Path<R, K, Self>;
}

#[diagnostic::do_not_recommend]
impl Module for ParametrizationList {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        for (name, p) in self.original_names().iter().zip(&self.originals) {
            f(Name::Field(name), Child::Param(p));
        }
        for (i, p) in self.chain.iter().enumerate() {
            let module: &dyn Module = &**p;
            f(
                Name::Index(i),
                Child::Module {
                    module,
                    shared: None,
                },
            );
        }
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        let names = self.original_names();
        for (name, p) in names.iter().zip(&mut self.originals) {
            f(Name::Field(name), ChildMut::Param(p));
        }
        for (i, p) in self.chain.iter_mut().enumerate() {
            let module: &mut dyn Module = &mut **p;
            f(Name::Index(i), ChildMut::Module(module));
        }
    }
}

/// A layer's parametrizations: its `parametrizations` child, PyTorch's `ModuleDict` of
/// [`ParametrizationList`]s by tensor name. A layer holds one (flattened, so the child is the
/// layer's own) once a tensor of it is parametrized.
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct Parametrizations {
    pub(crate) parametrizations: ModuleDict<ParametrizationList>,
}

impl Parametrizations {
    /// The list of the tensor `name`, if it is parametrized.
    pub(crate) fn list(&self, name: &str) -> Option<&ParametrizationList> {
        self.parametrizations.get(name)
    }
}

/// `param`'s value as the layer computes with it: the parametrized tensor when `param` is the
/// stand-in of a parametrized tensor (the layer's `slot` holds its list under `name`), otherwise
/// the parameter's own ([`Param::tensor`]).
#[inline]
pub(crate) fn value_of(
    param: &Param,
    name: &str,
    slot: &Option<Box<Parametrizations>>,
) -> Result<Tensor> {
    if !param.is_parametrized() {
        return param.tensor();
    }
    match slot.as_ref().and_then(|s| s.list(name)) {
        Some(list) => list.compute(),
        None => param.tensor(), // the stand-in's own error
    }
}

/// [`value_of`] for an optional parameter (a bias).
pub(crate) fn optional_value_of(
    param: &Option<Param>,
    name: &str,
    slot: &Option<Box<Parametrizations>>,
) -> Result<Option<Tensor>> {
    param.as_ref().map(|p| value_of(p, name, slot)).transpose()
}

thread_local! {
    /// The parametrized tensors computed in the open [`cached`] scope, by list; `None` outside.
    static CACHE: RefCell<Option<HashMap<usize, Tensor>>> = const { RefCell::new(None) };
}

/// Runs `f` with every parametrized tensor computed once and reused (PyTorch's
/// `with parametrize.cached():`): a layer called several times in `f` (a recurrent step, weights
/// shared across calls) computes its weight norm or spectral norm once. Gradients still flow to
/// the originals through the one computation.
///
/// The cache is this thread's, lasts while `f` runs (nested scopes share the outer one), and is
/// dropped when `f` returns or panics. Inside it, a change to the originals is not seen until the
/// scope ends, as in PyTorch.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::parametrize::{cached, spectral_norm, SpectralNormOptions};
///
/// let mut fc = Linear::new(4, 4, &Device::Cpu)?;
/// spectral_norm(&mut fc, "weight", SpectralNormOptions::default())?;
/// let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu)?;
/// // One power iteration for both calls, as PyTorch's `cached()`.
/// let (a, b) = cached(|| Ok::<_, Error>((fc.call(&x)?, fc.call(&x)?)))?;
/// assert_eq!(a.to_vec2::<f32>()?, b.to_vec2::<f32>()?);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn cached<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            if self.0 {
                CACHE.with(|c| *c.borrow_mut() = None);
            }
        }
    }
    let opened = CACHE.with(|c| {
        let mut c = c.borrow_mut();
        let open = c.is_none();
        if open {
            *c = Some(HashMap::new());
        }
        open
    });
    let _restore = Restore(opened);
    f()
}
