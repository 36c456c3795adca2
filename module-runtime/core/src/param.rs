//! Trainable parameters.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLockReadGuard};

use candle_core::{DType, Device, Shape, Tensor, Var};

use crate::error::{Error, Result};
use crate::identity::{self, ModeMarks};
use crate::lazy_cell::{check_built_dims, check_same_layout, is_cannot_set, Init, LazyCell};
use crate::lazy_shape::LazyShape;
use crate::offload::OffloadSlot;
use crate::quant_slot::QuantSlot;
use crate::update_lock::atomic_update;

/// A trainable floating-point tensor: PyTorch's `nn.Parameter`.
///
/// A `Param` is a shared handle to a cell holding a candle [`Var`], so:
///
/// - **a clone is the same parameter**: this is how weights are tied. Traversal lists it once, under
///   the first path it is reached by, and [`trainable_vars`](../module_runtime/trait.ModuleExt.html#method.trainable_vars) holds it
///   once;
/// - moving it ([`to_device`](Self::to_device), [`to_dtype`](Self::to_dtype)) replaces the `Var` in
///   the cell, and every alias sees the new one. Optimizers hold `Var`s, so build them *after* moving
///   a model;
/// - loading a value ([`set`](Self::set)) copies into the existing `Var` in place, so an optimizer
///   built before the load keeps training the loaded values;
/// - every write (`set`, `assign`, moves, quantizing) is an [update](crate::atomic_update): a
///   call running on another thread sees the value of before or the one of after, whole.
///
/// `requires_grad` is a property of the parameter (shared by all aliases). A frozen parameter is read
/// as a detached tensor, so no gradient is computed for it, and it is left out of `trainable_vars`.
///
/// A parameter may be *lazy* ([`Param::lazy`]): created *unbuilt*, with a shape some of whose
/// dimensions are unknown, and materialized once, with the dimensions the first input decides
/// ([`materialize`](Self::materialize)) or the values a checkpoint holds ([`set`](Self::set)).
/// An unbuilt parameter holds no values: reading it ([`tensor`](Self::tensor),
/// [`var`](Self::var)) is [`Error::NotLoaded`](crate::Error::NotLoaded), as PyTorch raises
/// "Attempted to use an uninitialized parameter". Its metadata stays readable: it has the dtype and
/// device it will be built with (which `to_device`/`to_dtype` change like any other parameter's),
/// [`lazy_shape`](Self::lazy_shape) says its shape, and [`shape`](Self::shape) is `[0]` (so
/// [`elem_count`](Self::elem_count) is 0) until it is built.
///
/// ```
/// use module_runtime::{Param, candle_core::{Device, Tensor}};
/// let w = Param::new(Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu)?)?;
/// let tied = w.clone();
/// assert!(tied.same_as(&w));
/// w.set(&Tensor::ones((2, 3), candle_core::DType::F32, &Device::Cpu)?)?;
/// assert_eq!(tied.tensor()?.sum_all()?.to_scalar::<f32>()?, 6.0);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone)]
pub struct Param(pub(crate) Arc<ParamInner>);

pub(crate) struct ParamInner {
    /// Train/eval flags of the modules this is the first leaf of.
    pub(crate) modes: ModeMarks,
    pub(crate) var: LazyCell<Var>,
    pub(crate) requires_grad: AtomicBool,
    /// The quantized weight, when the parameter is quantized (`quant.rs`).
    pub(crate) quant: QuantSlot,
    /// Where the values are kept when the parameter is offloaded (`offload.rs`).
    pub(crate) offload: OffloadSlot,
    /// Whether this is a parametrized tensor's stand-in (`parametrized.rs`): hidden from walks,
    /// not readable.
    pub(crate) parametrized: bool,
}

impl Param {
    /// A trainable parameter holding `value` (copied into a fresh `Var`).
    ///
    /// Fails with [`Error::NonFloatParam`] for integer tensors: only floating-point values have
    /// gradients.
    pub fn new(value: Tensor) -> Result<Self> {
        check_float(&value)?;
        Ok(Self::from_var_unchecked(Var::from_tensor(&value)?))
    }

    /// Wraps an existing `Var` (for instance one a `candle_nn::VarMap` created) without copying.
    pub fn from_var(var: Var) -> Result<Self> {
        check_float(var.as_tensor())?;
        Ok(Self::from_var_unchecked(var))
    }

    fn from_var_unchecked(var: Var) -> Self {
        Self(Arc::new(ParamInner {
            modes: ModeMarks::default(),
            var: LazyCell::eager(var),
            requires_grad: AtomicBool::new(true),
            quant: QuantSlot::default(),
            offload: Default::default(),
            parametrized: false,
        }))
    }

    /// An unbuilt parameter of floating-point `dtype` on `device`, to be built with a shape that
    /// `shape` accepts, initialized by `init` (PyTorch's `UninitializedParameter`).
    ///
    /// ```
    /// use module_runtime::{Init, LazyShape, Param};
    /// use module_runtime::candle_core::{DType, Device};
    ///
    /// let w = Param::lazy(LazyShape::new([Some(4), None]), Init::UniformFanIn, DType::F32, &Device::Cpu)?;
    /// assert!(!w.is_built());
    /// assert_eq!(w.lazy_shape().unwrap().to_string(), "[4, ?]");
    /// let t = w.materialize(&[4, 3], 3)?;
    /// assert!(w.is_built());
    /// assert_eq!(t.dims(), [4, 3]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn lazy(shape: LazyShape, init: Init, dtype: DType, device: &Device) -> Result<Self> {
        if !dtype.is_float() {
            return Err(Error::NonFloatParam {
                dtype,
                shape: Shape::from(0),
            });
        }
        Ok(Self(Arc::new(ParamInner {
            modes: ModeMarks::default(),
            var: LazyCell::lazy(shape, init, dtype, device)?,
            requires_grad: AtomicBool::new(true),
            quant: QuantSlot::default(),
            offload: Default::default(),
            parametrized: false,
        })))
    }

    /// A parameter of shape `shape` initialized by `init` (given the layer's `fan_in`, which
    /// [`Init::UniformFanIn`] uses): the constructor layers use, so that under
    /// [`empty_weights`](crate::empty_weights) the parameter is left empty for a load instead of
    /// drawing values that would be overwritten.
    ///
    /// ```
    /// use module_runtime::{Init, Param};
    /// use module_runtime::candle_core::{DType, Device};
    ///
    /// let w = Param::init((3, 4), Init::UniformFanIn, 4, DType::F32, &Device::Cpu)?;
    /// assert!(w.is_built());
    /// let bound = 1.0 / 2.0; // 1/sqrt(fan_in)
    /// assert!(w.tensor()?.abs()?.max_all()?.to_scalar::<f32>()? <= bound);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn init(
        shape: impl Into<Shape>,
        init: Init,
        fan_in: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if !dtype.is_float() {
            return Err(Error::NonFloatParam {
                dtype,
                shape: shape.into(),
            });
        }
        Ok(Self(Arc::new(ParamInner {
            modes: ModeMarks::default(),
            var: LazyCell::init(&shape.into(), init, fan_in, dtype, device)?,
            requires_grad: AtomicBool::new(true),
            quant: QuantSlot::default(),
            offload: Default::default(),
            parametrized: false,
        })))
    }

    /// Whether the parameter has values: always for an eager parameter, once materialized for a
    /// lazy one.
    pub fn is_built(&self) -> bool {
        self.0.var.is_built()
    }

    /// The shape an unbuilt parameter will be built with (`?` for unknown dimensions); `None` once
    /// built.
    pub fn lazy_shape(&self) -> Option<LazyShape> {
        self.0.var.lazy_shape()
    }

    /// Builds an unbuilt parameter with shape `dims` (its init recipe given the layer's `fan_in`),
    /// once: when several threads get here first, one builds and the others get its value. Returns
    /// the value to compute with, like [`tensor`](Self::tensor).
    ///
    /// On a built parameter (eager, or lazy and built already) this only checks that `dims` is its
    /// shape. Fails with [`Error::LazyShape`] when `dims` does not fit.
    ///
    /// Inside a functional call that substitutes this parameter, nothing is built: the substituted
    /// tensor is checked against `dims` and returned.
    pub fn materialize(&self, dims: &[usize], fan_in: usize) -> Result<Tensor> {
        if let Some(t) = self.substituted() {
            return check_built_dims(t, dims);
        }
        self.0.var.materialize(dims, fan_in)?;
        check_built_dims(self.current()?, dims)
    }

    /// The value to compute with in a forward pass, or [`Error::NotLoaded`]
    /// when the parameter has no values yet: made under [`empty_weights`](crate::empty_weights)
    /// and not loaded, or lazy and not built (PyTorch: "Attempted to use an uninitialized
    /// parameter"). Lazy layers call [`materialize`](Self::materialize) instead, which builds it.
    ///
    /// Gradients flow to the parameter unless it is frozen or read under
    /// [`no_grad`](crate::no_grad), in which case the tensor is detached (it records no operation,
    /// so layers take their fused inference kernels).
    ///
    /// Inside a functional call ([`FunctionalExt`](../module_runtime/trait.FunctionalExt.html)) that substitutes this
    /// parameter, it reads as the substituted tensor instead (detached under `no_grad`), built or
    /// not.
    ///
    /// ```
    /// use module_runtime::{Error, Init, LazyShape, Param};
    /// use module_runtime::candle_core::{DType, Device};
    /// let w = Param::lazy(LazyShape::new([Some(4), None]), Init::UniformFanIn, DType::F32, &Device::Cpu)?;
    /// assert!(matches!(w.tensor(), Err(Error::NotLoaded { .. })));
    /// w.materialize(&[4, 3], 3)?;
    /// assert_eq!(w.tensor()?.dims(), [4, 3]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn tensor(&self) -> Result<Tensor> {
        self.refuse_parametrized()?;
        if let Some(t) = self.substituted() {
            return Ok(t);
        }
        match self.0.var.unbuilt_error("parameter") {
            None => self.current(),
            Some(e) => Err(e),
        }
    }

    /// What [`tensor`](Self::tensor) returns, without the unbuilt check: an unbuilt parameter
    /// reads as its empty `[0]` placeholder. For the runtime's own walks (moves, state dicts of
    /// checked models), never for computing.
    ///
    /// A [quantized](Self::quantize) parameter keeps no float copy of its values: they are
    /// dequantized into a fresh tensor on every call (the only error this returns).
    pub fn current(&self) -> Result<Tensor> {
        if let Some(t) = self.substituted() {
            return Ok(t);
        }
        if self.is_quantized() || self.0.offload.is_on() {
            return self.own_tensor();
        }
        let var = self.read();
        Ok(
            if self.requires_grad() && crate::grad_mode::is_grad_enabled() {
                var.as_tensor().clone()
            } else {
                var.as_tensor().detach()
            },
        )
    }

    /// The tensor a functional scope on this thread substitutes for this parameter, if one is
    /// active and does (see [`scoped`](Self::scoped)).
    #[inline]
    fn substituted(&self) -> Option<Tensor> {
        if crate::scope::active() {
            self.scoped()
        } else {
            None
        }
    }

    /// The tensor the active functional scope substitutes for this parameter, detached under
    /// `no_grad` as parameters are. The substituted tensor's own tracking decides whether
    /// gradients flow (as in PyTorch, where the swapped-in tensor's `requires_grad` is its own).
    #[cold]
    fn scoped(&self) -> Option<Tensor> {
        let t = crate::scope::param(self.id())?;
        Some(if crate::grad_mode::is_grad_enabled() {
            t
        } else {
            t.detach()
        })
    }

    /// Rows `ids` (flat integer ids) of this `[rows, dim]` parameter as the active functional
    /// scope looks them up, or `None` when no scope has a lookup for it: read
    /// [`tensor`](Self::tensor) and select the rows then. A layer that reads rows of a table (an
    /// embedding) asks this first, so that a scope that can answer without the whole table does:
    /// module-optim's `FullyShardedDataParallel` looks the rows up in the gathered table and sends their gradient to the shards, so the table is never gathered again
    /// for the backward. Detached under `no_grad`, as [`tensor`](Self::tensor) is.
    ///
    /// ```
    /// use module_core::Param;
    /// # use candle_core::{Device, DType, Tensor};
    /// let table = Param::new(Tensor::zeros((4, 2), DType::F32, &Device::Cpu)?)?;
    /// let ids = Tensor::new(&[0u32, 3], &Device::Cpu)?;
    /// assert!(table.scoped_rows(&ids)?.is_none()); // no scope: read `tensor()` instead
    /// # Ok::<(), module_core::Error>(())
    /// ```
    pub fn scoped_rows(&self, ids: &Tensor) -> Result<Option<Tensor>> {
        // A parametrized parameter's value is computed from its originals, never looked up.
        if !crate::scope::active() || self.0.parametrized {
            return Ok(None);
        }
        let Some(lookup) = crate::scope::rows(self.id()) else {
            return Ok(None);
        };
        let rows = lookup(ids)?;
        Ok(Some(if crate::grad_mode::is_grad_enabled() {
            rows
        } else {
            rows.detach()
        }))
    }

    /// The candle `Var` behind the parameter (whether frozen or not), for candle's optimizers
    /// and `GradStore` lookups; [`Error::NotLoaded`] when the parameter
    /// is not built (see [`tensor`](Self::tensor)).
    ///
    /// A [quantized](Self::quantize) parameter has no `Var` of its values: this is a fresh one
    /// holding them dequantized (writing to it leaves the parameter as it is).
    pub fn var(&self) -> Result<Var> {
        self.refuse_parametrized()?;
        match self.0.var.unbuilt_error("parameter") {
            None => self.current_var(),
            Some(e) => Err(e),
        }
    }

    /// The `Var` behind the parameter, an unbuilt one's empty placeholder included (see
    /// [`current`](Self::current)); for a quantized parameter a fresh one, as [`var`](Self::var)
    /// says.
    pub fn current_var(&self) -> Result<Var> {
        if self.is_quantized() || self.0.offload.is_on() {
            return Ok(Var::from_tensor(&self.own_tensor()?)?);
        }
        Ok(self.read().clone())
    }

    /// The parameter's own values, whatever a functional scope substitutes, detached (as
    /// [`Buffer::own_tensor`](crate::Buffer::own_tensor)): what a state dict saves. A
    /// [quantized](Self::quantize) parameter's are dequantized into a fresh tensor (the only
    /// error this returns); an unbuilt one reads as its empty placeholder.
    pub fn own_tensor(&self) -> Result<Tensor> {
        if let Some(value) = self.0.offload.load() {
            return Ok(value?.detach());
        }
        match self.0.quant.entry() {
            Some(entry) => {
                let var = self.read();
                Ok(entry
                    .weight()?
                    .dequantize(var.device())?
                    .to_dtype(var.dtype())?)
            }
            None => Ok(self.read().as_tensor().detach()),
        }
    }

    /// Whether the parameter is trained (PyTorch's `requires_grad`). New parameters are; a
    /// [quantized](Self::quantize) one never is.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed) && !self.is_quantized() && !self.is_offloaded()
    }

    /// Freezes (`false`) or unfreezes (`true`) this parameter and every alias of it. A
    /// [quantized](Self::quantize) parameter stays frozen until it is
    /// [dequantized](Self::dequantize); the flag is kept for then.
    pub fn set_requires_grad(&self, requires_grad: bool) {
        self.0.requires_grad.store(requires_grad, Ordering::Relaxed);
    }

    /// The parameter's shape (a quantized parameter's is its weight's).
    pub fn shape(&self) -> Shape {
        if let Some(shape) = self.0.offload.shape() {
            return shape;
        }
        match self.0.quant.entry() {
            Some(entry) => entry.shape().clone(),
            None => self.read().shape().clone(),
        }
    }

    /// The parameter's dtype.
    pub fn dtype(&self) -> DType {
        self.read().dtype()
    }

    /// The device the parameter lives on.
    pub fn device(&self) -> Device {
        self.read().device().clone()
    }

    /// Number of scalar values.
    pub fn elem_count(&self) -> usize {
        self.shape().elem_count()
    }

    /// Copies `value` into the parameter in place (every alias, and optimizers holding its `Var`,
    /// see the new value). The shape and dtype must match; the value may live on another device.
    ///
    /// An unbuilt parameter is built from `value` instead (its init recipe is not used): the
    /// shape must be one its [`lazy_shape`](Self::lazy_shape) accepts and the dtype its own.
    ///
    /// A [quantized](Self::quantize) parameter quantizes `value` to its kind again (and keeps no
    /// float copy of it, as [`quantize`](Self::quantize) leaves it).
    pub fn set(&self, value: &Tensor) -> Result<()> {
        self.refuse_parametrized()?;
        if let Some(written) = self.0.offload.write(value, self.dtype()) {
            return written;
        }
        match self.quantized_dtype() {
            Some(kind) => self.set_requantized(value, kind, self.0.var.dtype()),
            None => self.set_value(value),
        }
    }

    /// [`set`](Self::set) without quantizing.
    pub(crate) fn set_value(&self, value: &Tensor) -> Result<()> {
        let value = value.to_device(&self.0.var.device())?;
        atomic_update(|| {
            if self.0.var.build_from(&value)? {
                return Ok(());
            }
            let var = self.read();
            check_same_layout(&var, &value)?;
            match var.set(&value) {
                // The value is a view of the parameter itself (e.g. from its own state dict):
                // candle refuses to copy a storage onto itself, so copy through a fresh buffer.
                Err(e) if is_cannot_set(&e) => Ok(var.set(&value.copy()?)?),
                other => Ok(other?),
            }
        })
    }

    /// Takes `value` as the parameter's new value instead of copying into the current one (a load
    /// with [`LoadOptions::assign`](../module_runtime/struct.LoadOptions.html#method.assign), PyTorch's
    /// `load_state_dict(assign=True)`): the parameter gets `value`'s dtype, keeps its device, and
    /// shares `value`'s storage when `value` is a candle variable (as a checkpoint read from a file
    /// is), so nothing is copied. An unbuilt parameter is built from it. Every alias sees the new
    /// value; optimizers built before hold the old `Var` (build them after loading).
    ///
    /// The shape must be the parameter's (or one an unbuilt parameter accepts) and the dtype a
    /// floating-point one.
    ///
    /// A [quantized](Self::quantize) parameter quantizes `value` to its kind again, as
    /// [`set`](Self::set) does.
    pub fn assign(&self, value: &Tensor) -> Result<()> {
        self.refuse_parametrized()?;
        check_float(value)?;
        if let Some(written) = self.0.offload.write(value, self.dtype()) {
            return written;
        }
        let value = value.to_device(&self.0.var.device())?;
        match self.quantized_dtype() {
            Some(kind) => self.set_requantized(&value, kind, value.dtype()),
            None => atomic_update(|| self.0.var.assign(value)),
        }
    }

    /// Moves the parameter to `device` (a no-op when it is already there); a quantized weight
    /// moves with it.
    pub fn to_device(&self, device: &Device) -> Result<()> {
        let quant = self.quant_on(device)?;
        atomic_update(|| {
            self.replace_with(|t| {
                if t.device().same_device(device) {
                    Ok(None)
                } else {
                    Ok(Some(t.to_device(device)?))
                }
            })?;
            self.0.quant.store(quant);
            Ok(())
        })
    }

    /// Converts the parameter to the floating-point `dtype` (a no-op when it already has it).
    pub fn to_dtype(&self, dtype: DType) -> Result<()> {
        if !dtype.is_float() {
            return Err(Error::NonFloatParam {
                dtype,
                shape: self.shape(),
            });
        }
        self.replace_with(|t| {
            if t.dtype() == dtype {
                Ok(None)
            } else {
                Ok(Some(t.to_dtype(dtype)?))
            }
        })
    }

    /// Replaces the `Var` with `f`'s conversion of its value, if any: an
    /// [update](crate::atomic_update).
    /// An offloaded parameter keeps its place and dtype (its source holds them).
    fn replace_with(&self, f: impl FnOnce(&Tensor) -> Result<Option<Tensor>>) -> Result<()> {
        if self.is_offloaded() {
            return Ok(());
        }
        atomic_update(|| {
            let mut var = self.0.var.write();
            if let Some(new) = f(var.as_tensor())? {
                *var = Var::from_tensor(&new)?;
            }
            Ok(())
        })
    }

    /// Swaps in a converted `Var` (a move or dtype change), for every alias at once.
    pub fn replace_var(&self, var: Var) {
        atomic_update(|| self.0.var.replace(var));
    }

    /// A new parameter holding a copy of this one's value, with its `requires_grad` (a deep copy:
    /// not an alias). Built parameters only.
    pub fn deep_copy(&self) -> Result<Self> {
        // `Var::from_tensor` copies a tensor that is not a variable (a detached view is not). An
        // offloaded parameter's copy holds its values.
        let value = match self.0.offload.load() {
            Some(value) => value?,
            None => self.read().as_tensor().detach(),
        };
        Ok(Self(Arc::new(ParamInner {
            modes: self.0.modes.snapshot(),
            var: LazyCell::eager(Var::from_tensor(&value)?),
            requires_grad: AtomicBool::new(self.0.requires_grad.load(Ordering::Relaxed)),
            quant: QuantSlot::with_entry(self.0.quant.entry()),
            offload: Default::default(),
            parametrized: self.0.parametrized,
        })))
    }

    /// The `Var` the cell holds: a quantized parameter's empty stand-in, which moves and dtype
    /// conversions change like any value (it carries the parameter's dtype and device).
    pub(crate) fn read(&self) -> RwLockReadGuard<'_, Var> {
        self.0.var.read()
    }
}

fn check_float(t: &Tensor) -> Result<()> {
    if t.dtype().is_float() {
        Ok(())
    } else {
        Err(Error::NonFloatParam {
            dtype: t.dtype(),
            shape: t.shape().clone(),
        })
    }
}

identity::leaf_identity!(Param, "parameter");

impl std::fmt::Debug for Param {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let lazy_shape = self.lazy_shape();
        let shape = self.shape();
        let var = self.read();
        let mut f = f.debug_struct("Param");
        match &lazy_shape {
            Some(shape) => f.field("unbuilt", &format_args!("{shape}")),
            None => f.field("shape", &shape.dims()),
        };
        if let Some(kind) = self.quantized_dtype() {
            f.field("quantized", &kind);
        }
        f.field("dtype", &var.dtype())
            .field("device", &var.device().location())
            .field("requires_grad", &self.requires_grad())
            .finish()
    }
}
