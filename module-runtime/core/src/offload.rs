//! Offloaded parameters: a [`Param`] whose values live somewhere else than the model (the CPU's
//! memory for a model computing on a GPU, a file on disk) and are read each time the parameter
//! is, Hugging Face Accelerate's CPU and disk offload.
//!
//! The design mirrors the quantized weights' (`quant.rs`): the parameter's `Var` becomes an
//! empty stand-in carrying its dtype and the device it computes on, its shape is kept beside it,
//! and everything that reads it as a tensor ([`Param::tensor`], a state dict, a deep copy) gets
//! a fresh tensor from its [`OffloadSource`], which the reader frees when it drops it. So a layer
//! reads its weight from disk as its `forward` starts and the weight is gone when the layer's
//! output is made (under `no_grad`; a recorded graph keeps what it used until its backward, as in
//! PyTorch). A write ([`Param::set`], a `load_state_dict`) goes to the source: the parameter
//! stays offloaded. An offloaded parameter is not trained (`requires_grad` reads `false`, as a
//! quantized one's), like Accelerate's offloaded weights, which only inference reads.
//!
//! `module_runtime::nn::big_modeling` (`dispatch_model`) offloads parameters by a device map;
//! its sources are a tensor in CPU memory and a safetensors file per weight.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use candle_core::{DType, Device, Shape, Tensor, Var};

use crate::error::{DeviceMapError, Error, Result};
use crate::param::Param;
use crate::update_lock::atomic_update;

/// Where an offloaded parameter's values are kept, and how they are read and written.
pub trait OffloadSource: Send + Sync + 'static {
    /// The values, as a fresh tensor on the device the parameter computes on (every read makes
    /// one; the reader frees it).
    fn load(&self) -> Result<Tensor>;

    /// Replaces the kept values with `value` (of the parameter's shape and dtype, checked before).
    fn store(&self, value: &Tensor) -> Result<()>;

    /// The kept values' shape and dtype, without reading them (a file's header).
    fn layout(&self) -> Result<(Shape, DType)>;

    /// Where the values are, for messages and `Debug`: `cpu`, `disk (<file>)`.
    fn location(&self) -> String;
}

/// A parameter's offload: a flag read on every parameter read (one atomic load, so other
/// parameters pay nothing more) and the source with the values' shape behind a lock.
#[derive(Default)]
pub(crate) struct OffloadSlot {
    on: AtomicBool,
    entry: RwLock<Option<(Arc<dyn OffloadSource>, Shape)>>,
}

impl OffloadSlot {
    #[inline]
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Acquire)
    }

    fn entry(&self) -> Option<(Arc<dyn OffloadSource>, Shape)> {
        self.entry
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn store(&self, entry: Option<(Arc<dyn OffloadSource>, Shape)>) {
        let on = entry.is_some();
        *self.entry.write().unwrap_or_else(PoisonError::into_inner) = entry;
        self.on.store(on, Ordering::Release);
    }

    /// The offloaded values' shape.
    pub(crate) fn shape(&self) -> Option<Shape> {
        self.entry().map(|(_, shape)| shape)
    }

    /// The values, read from the source (`None` when not offloaded).
    pub(crate) fn load(&self) -> Option<Result<Tensor>> {
        self.entry().map(|(source, _)| source.load())
    }

    /// Writes `value` to the source, after checking it against the parameter's layout.
    pub(crate) fn write(&self, value: &Tensor, dtype: candle_core::DType) -> Option<Result<()>> {
        let (source, shape) = self.entry()?;
        if value.shape() != &shape || value.dtype() != dtype {
            return Some(Err(Error::ValueMismatch {
                expected_shape: shape,
                expected_dtype: dtype,
                shape: value.shape().clone(),
                dtype: value.dtype(),
            }));
        }
        Some(source.store(value))
    }
}

impl Param {
    /// Offloads the parameter to `source`, which already holds its values: the parameter's own
    /// values are freed, and every read from now on is a fresh tensor `source` loads on
    /// `device` (the device it computes on, which [`device`](Self::device) reports). What
    /// `dispatch_model` does to the parameters a device map puts on `cpu` or `disk`; most code
    /// never calls it.
    ///
    /// The source's [layout](OffloadSource::layout) must be the parameter's shape and dtype
    /// ([`Error::ValueMismatch`]); an unbuilt parameter (a model built with `build_empty`) is
    /// built by it, never holding the values, if its lazy shape accepts the shape. Refused for a
    /// quantized or parametrized parameter.
    ///
    /// ```
    /// use std::sync::Arc;
    /// use module_runtime::{OffloadSource, Param, Result};
    /// use module_runtime::candle_core::{DType, Device, Shape, Tensor};
    ///
    /// struct Kept(Tensor);
    /// impl OffloadSource for Kept {
    ///     fn load(&self) -> Result<Tensor> { Ok(self.0.copy()?) }
    ///     fn store(&self, _: &Tensor) -> Result<()> { Ok(()) }
    ///     fn layout(&self) -> Result<(Shape, DType)> { Ok((self.0.shape().clone(), self.0.dtype())) }
    ///     fn location(&self) -> String { "elsewhere".into() }
    /// }
    /// let w = Param::new(Tensor::ones((2, 3), DType::F32, &Device::Cpu)?)?;
    /// w.offload(Arc::new(Kept(w.tensor()?.copy()?)), &Device::Cpu)?;
    /// assert!(w.is_offloaded() && !w.requires_grad());
    /// assert_eq!(w.shape().dims(), [2, 3]);
    /// assert_eq!(w.tensor()?.sum_all()?.to_scalar::<f32>()?, 6.0);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn offload(&self, source: Arc<dyn OffloadSource>, device: &Device) -> Result<()> {
        self.refuse_parametrized()?;
        if self.is_quantized() {
            return Err(DeviceMapError::NotOffloadable {
                path: "parameter".into(),
                reason: "it is quantized (dequantize it first)".into(),
            }
            .into());
        }
        let (shape, dtype) = source.layout()?;
        let built = self.is_built();
        if dtype != self.dtype() || (built && shape != self.shape()) {
            return Err(Error::ValueMismatch {
                expected_shape: self.shape(),
                expected_dtype: self.dtype(),
                shape,
                dtype,
            });
        }
        let stand_in = Var::zeros(0, dtype, device)?;
        atomic_update(|| {
            if !built {
                // Built as the source's shape, holding the stand-in (refused if the lazy shape
                // does not accept it).
                self.0.var.build_as(shape.dims(), stand_in.clone())?;
            }
            // The source first: a reader in between sees the values, never the stand-in.
            self.0.offload.store(Some((source, shape)));
            self.0.var.replace(stand_in);
            Ok(())
        })
    }

    /// Whether the parameter is [offloaded](Self::offload).
    pub fn is_offloaded(&self) -> bool {
        self.0.offload.is_on()
    }

    /// Where an offloaded parameter's values are ([`OffloadSource::location`]), `None` when it is
    /// not offloaded.
    pub fn offload_location(&self) -> Option<String> {
        self.0.offload.entry().map(|(source, _)| source.location())
    }

    /// Brings an offloaded parameter's values back into it, on `device` (a no-op when it is not
    /// offloaded): the parameter is an ordinary one again.
    pub fn onload(&self, device: &Device) -> Result<()> {
        let Some(value) = self.0.offload.load() else {
            return Ok(());
        };
        let var = Var::from_tensor(&value?.to_device(device)?)?;
        atomic_update(|| {
            self.0.var.replace(var);
            self.0.offload.store(None);
        });
        Ok(())
    }
}
