//! Quantized parameters: a [`Param`] that holds a quantized weight (candle's [`QTensor`]) for
//! `Linear` layers to multiply with, PyTorch's dynamically quantized weights.
//!
//! The design, in short: the quantized weight lives in the parameter's shared cell, next to its
//! `Var`, so every alias of a tied weight sees it, and the model's type does not change (a
//! quantized `Linear` is still a `Linear`). No float copy of the values stays resident (that is
//! what quantizing is for: a 7B model's `q4_0` GGUF is 3.8 GB, its float32 values 28 GB): the
//! parameter's `Var` becomes an empty stand-in that carries its dtype and device, its shape is
//! the weight's, and everything that reads it as a tensor ([`Param::tensor`], `state_dict`, a
//! functional call's copy) gets the quantized values dequantized into a fresh tensor — exactly
//! what the model computes with, so a state dict saves what the model uses, nothing silently
//! different. An `Embedding` tied to a quantized head looks up its rows in the quantized table
//! (as llama.cpp does with a quantized `token_embd`) without dequantizing the rest. A kernel's
//! layout of the weight that holds all of its bytes (the `q8_0` kernel's tiles on the CPU) takes
//! the weight's place once made ([`QuantizedLayout`]), so the weight is in memory once.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{k_quants, GgmlDType, QStorage, QTensor};
use candle_core::{DType, Device, Tensor, Var};

use crate::error::{QuantizeError, Result};
use crate::param::Param;
use crate::quant_slot::{Entry, QuantizedLayout};
use crate::update_lock::atomic_update;

/// Whether `kind` is one of the float kinds (`F32`, `F16`, `BF16`) a GGUF tensor may have,
/// rather than a quantization.
pub fn is_float_kind(kind: GgmlDType) -> bool {
    matches!(kind, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

/// Checks that `kind` is a quantization, not a float kind ([`is_float_kind`]).
pub fn check_quantized_kind(kind: GgmlDType) -> Result<()> {
    if is_float_kind(kind) {
        return Err(QuantizeError::FloatKind { kind }.into());
    }
    Ok(())
}

/// Checks that `kind` is a quantization whose blocks fit the rows of a weight of shape `dims`.
pub fn check_quantizable(path: &str, dims: &[usize], kind: GgmlDType) -> Result<()> {
    check_quantized_kind(kind)?;
    let block_size = kind.block_size();
    match dims {
        [_, cols] if cols % block_size == 0 => Ok(()),
        _ => Err(QuantizeError::BlockSize {
            path: path.to_owned(),
            shape: dims.into(),
            kind,
            block_size,
        }
        .into()),
    }
}

/// `value` quantized to `kind`.
///
/// On the CPU the rows are quantized in chunks of about a million values, in parallel, each
/// converted to float32 on its own: a `bfloat16` embedding table of 128,256 × 3,072 is never
/// whole in float32 (1.5 GB), which is what lets a streaming load stay within the quantized
/// model's size. The blocks run along the rows, so the bytes are those of quantizing the whole
/// tensor at once.
pub fn quantize_value(value: &Tensor, kind: GgmlDType) -> Result<Arc<QTensor>> {
    check_quantizable("parameter", value.dims(), kind)?;
    if !value.device().is_cpu() {
        return Ok(Arc::new(QTensor::quantize(&value.contiguous()?, kind)?));
    }
    let storage = match kind {
        GgmlDType::Q4_0 => quantize_rows::<k_quants::BlockQ4_0>(value)?,
        GgmlDType::Q4_1 => quantize_rows::<k_quants::BlockQ4_1>(value)?,
        GgmlDType::Q5_0 => quantize_rows::<k_quants::BlockQ5_0>(value)?,
        GgmlDType::Q5_1 => quantize_rows::<k_quants::BlockQ5_1>(value)?,
        GgmlDType::Q8_0 => quantize_rows::<k_quants::BlockQ8_0>(value)?,
        GgmlDType::Q8_1 => quantize_rows::<k_quants::BlockQ8_1>(value)?,
        GgmlDType::Q2K => quantize_rows::<k_quants::BlockQ2K>(value)?,
        GgmlDType::Q3K => quantize_rows::<k_quants::BlockQ3K>(value)?,
        GgmlDType::Q4K => quantize_rows::<k_quants::BlockQ4K>(value)?,
        GgmlDType::Q5K => quantize_rows::<k_quants::BlockQ5K>(value)?,
        GgmlDType::Q6K => quantize_rows::<k_quants::BlockQ6K>(value)?,
        GgmlDType::Q8K => quantize_rows::<k_quants::BlockQ8K>(value)?,
        _ => return Ok(Arc::new(QTensor::quantize(&value.contiguous()?, kind)?)),
    };
    Ok(Arc::new(QTensor::new(storage, value.shape().clone())?))
}

/// Values per chunk of [`quantize_rows`]: 4 MiB of float32.
const CHUNK_VALUES: usize = 1 << 20;

/// The CPU matrix `value` (`[rows, cols]`, `cols` a multiple of `T`'s block) quantized to `T`'s
/// blocks, whole rows at a time, the chunks in parallel.
fn quantize_rows<T: k_quants::GgmlType + 'static>(value: &Tensor) -> Result<QStorage> {
    use rayon::prelude::*;
    let (rows, cols) = value.dims2()?;
    let per_row = cols / T::BLCK_SIZE;
    let rows_per_chunk = (CHUNK_VALUES / cols.max(1)).max(1);
    let mut blocks = vec![T::zeros(); rows * per_row];
    blocks
        .par_chunks_mut((rows_per_chunk * per_row).max(1))
        .enumerate()
        .try_for_each(|(i, out)| -> Result<()> {
            let part = value.narrow(0, i * rows_per_chunk, out.len() / per_row.max(1))?;
            let xs = part.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
            T::from_float(&xs, out);
            Ok(())
        })?;
    Ok(QStorage::Cpu(Box::new(blocks)))
}

/// `q` on `device` (the same tensor when it is there already).
pub fn qtensor_on(q: &Arc<QTensor>, device: &Device) -> Result<Arc<QTensor>> {
    if q.device().same_device(device) {
        return Ok(q.clone());
    }
    let storage = QStorage::from_data(Cow::Borrowed(&q.data()?), device, q.dtype())?;
    Ok(Arc::new(QTensor::new(storage, q.shape().clone())?))
}

impl Param {
    /// Quantizes the parameter in place to `kind` (`GgmlDType::Q8_0`, `Q4_0`, `Q4K`, …), for
    /// every alias at once: PyTorch's dynamically quantized weight. `Linear` layers holding it
    /// multiply with a quantized matmul from then on.
    ///
    /// The parameter keeps its logical shape, dtype and device, and its float values are freed:
    /// reading it as a tensor ([`tensor`](Self::tensor), a state dict) dequantizes the weight
    /// into a fresh tensor, the values the model computes with. A quantized parameter is not trained:
    /// [`requires_grad`](Self::requires_grad) is `false` and it is left out of
    /// `trainable_vars`, until [`dequantize`](Self::dequantize). Loading a value into it
    /// ([`set`](Self::set), a state dict) quantizes the value again. An
    /// [offloaded](Self::offload) parameter is brought back first (its quantized weight is kept
    /// in memory).
    ///
    /// The weight must be a matrix whose rows (`in_features`) are a multiple of the kind's
    /// block size (32 for `q8_0`/`q4_0`, 256 for the k-quants), else
    /// [`QuantizeError::BlockSize`]; float kinds are [`QuantizeError::FloatKind`]. Whole models
    /// are quantized by path pattern with `module_runtime::nn::quantize`.
    ///
    /// A parameter with no values yet (made under [`empty_weights`](crate::empty_weights), with
    /// its whole shape known) is marked instead: [`quantized_dtype`](Self::quantized_dtype) says
    /// `kind` from then on, and the value a load (or [`set`](Self::set)) brings is quantized as it
    /// arrives, so the float values of the whole model are never in memory at once — a streaming
    /// load of a checkpoint larger than memory allows in float (Hugging Face's
    /// `from_pretrained(..., quantization_config=...)`).
    ///
    /// ```
    /// use module_runtime::{build_empty, Init, Param};
    /// use module_runtime::candle_core::{quantized::GgmlDType, DType, Device, Tensor};
    /// let w = build_empty(|| Param::init((4, 64), Init::Zeros, 64, DType::F32, &Device::Cpu))?;
    /// w.quantize(GgmlDType::Q8_0)?; // no values yet: marked
    /// assert_eq!((w.is_built(), w.quantized_dtype()), (false, Some(GgmlDType::Q8_0)));
    /// w.set(&Tensor::ones((4, 64), DType::F32, &Device::Cpu)?)?; // quantized as it arrives
    /// assert!(w.is_built() && w.is_quantized());
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// ```
    /// use module_runtime::{Param, candle_core::{quantized::GgmlDType, DType, Device, Tensor}};
    /// let w = Param::new(Tensor::randn(0f32, 1., (4, 64), &Device::Cpu)?)?;
    /// let before = w.tensor()?.copy()?; // `tensor()` shares the Var's storage
    /// w.quantize(GgmlDType::Q8_0)?;
    /// assert_eq!((w.quantized_dtype(), w.requires_grad()), (Some(GgmlDType::Q8_0), false));
    /// assert_eq!((w.shape().dims(), w.dtype()), (&[4usize, 64][..], DType::F32)); // the logical shape
    /// let err = (w.tensor()? - before)?.abs()?.max_all()?.to_scalar::<f32>()?;
    /// assert!(err > 0.0 && err < 0.05); // the dequantized values, within q8_0's step
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn quantize(&self, kind: GgmlDType) -> Result<()> {
        if !self.is_built() {
            return self.quantize_when_loaded(kind);
        }
        // An offloaded parameter's values come back first: the quantized weight is kept here.
        self.onload(&self.device())?;
        self.set_requantized(&self.var()?.as_tensor().detach(), kind, self.0.var.dtype())
    }

    /// [`quantize`](Self::quantize) of a parameter with no values: marks it, once its shape is
    /// known whole and fits `kind`'s blocks (else the error reading it would give, or
    /// [`QuantizeError::BlockSize`]).
    fn quantize_when_loaded(&self, kind: GgmlDType) -> Result<()> {
        let Some(dims) = self.lazy_shape().and_then(|s| s.known()) else {
            return self.var().map(|_| ()); // a lazy shape not known yet: its `NotLoaded` error
        };
        check_quantizable("parameter", &dims, kind)?;
        atomic_update(|| self.0.quant.set_pending(Some(kind)));
        Ok(())
    }

    /// Takes an already quantized weight (a GGUF file's tensor) as the parameter's value, moved
    /// to the parameter's device: `Linear` layers multiply with it and the float values are
    /// freed, as after [`quantize`](Self::quantize). The shape must be the parameter's (an unbuilt
    /// parameter is built with it, without ever holding float values). A float `weight` (`F32`,
    /// `F16`, `BF16`) is loaded as a plain value.
    pub fn set_quantized(&self, weight: impl Into<Arc<QTensor>>) -> Result<()> {
        let weight: Arc<QTensor> = weight.into();
        let device = self.0.var.device();
        if is_float_kind(weight.dtype()) {
            let value = weight.dequantize(&device)?.to_dtype(self.0.var.dtype())?;
            return self.set(&value);
        }
        let weight = qtensor_on(&weight, &device)?;
        self.store_quantized(weight, self.0.var.dtype())
    }

    /// The quantized weight to multiply with, if the parameter is quantized — `None` for a float
    /// parameter (one atomic load: cheap enough for every forward) and inside a functional call
    /// that substitutes the parameter (the substituted tensor is what counts then).
    ///
    /// Once a kernel's layout holds the whole weight ([`QuantizedLayout`]: the `q8_0` kernel's
    /// tiles on the CPU), the weight's own bytes are gone and this makes it again from the layout:
    /// a copy, for what reads the weight whole (a move, a state dict), not for every forward.
    pub fn quantized(&self) -> Result<Option<Arc<QTensor>>> {
        self.quant_entry().map(|e| e.weight()).transpose()
    }

    /// Rows `rows` of a quantized matrix weight `[n, k]` as a quantized `[rows.len(), k]` CPU
    /// tensor, read from the weight or the layout that holds it without making the rest (an
    /// embedding's lookup in a quantized table); `None` for a float parameter. A row outside the
    /// weight is [`QuantizeError::Row`].
    pub fn quantized_rows(&self, rows: &[usize]) -> Result<Option<QTensor>> {
        let Some(entry) = self.quant_entry() else {
            return Ok(None);
        };
        let (n, _) = entry.shape().dims2()?;
        if let Some(&row) = rows.iter().find(|&&r| r >= n) {
            return Err(QuantizeError::Row { row, rows: n }.into());
        }
        Ok(Some(entry.rows(rows)?))
    }

    /// The quantized weight's entry, where [`quantized`](Self::quantized) gives one: the
    /// parameter is quantized (one atomic load first) and no functional call substitutes it.
    #[inline]
    fn quant_entry(&self) -> Option<Arc<Entry>> {
        if !self.0.quant.is_on() {
            return None;
        }
        if crate::scope::active() && crate::scope::param(self.id()).is_some() {
            return None;
        }
        self.0.quant.entry()
    }

    /// A layout of the quantized weight that a kernel reads in its own order (repacked blocks),
    /// made by `make` from the weight on first use and kept with that weight until it changes (a
    /// load, a move, [`dequantize`](Self::dequantize)): `Linear`'s `q8_0` kernel keeps its tiles
    /// here, so they are made once per weight, not once per forward. `make` returning `None` (the
    /// layout does not apply to this weight) is kept as well. A layout that holds the whole
    /// weight replaces the weight's own bytes (see [`QuantizedLayout`]).
    ///
    /// `None` where [`quantized`](Self::quantized) is `None`, where `make` gave `None`, or where
    /// a layout of another type was made first (one layout per weight).
    ///
    /// ```
    /// use module_runtime::{Param, QuantizedLayout, candle_core::{quantized::GgmlDType, Device, Tensor}};
    /// /// How many bytes the weight has (a layout that keeps none of them).
    /// struct Size(usize);
    /// impl QuantizedLayout for Size {}
    /// let w = Param::new(Tensor::ones((2, 32), module_runtime::candle_core::DType::F32, &Device::Cpu)?)?;
    /// w.quantize(GgmlDType::Q8_0)?;
    /// let size = w.quantized_layout(|q| Some(Size(q.data().ok()?.len()))).unwrap();
    /// assert_eq!(size.0, 2 * 34); // two rows of one 34-byte block
    /// let again = w.quantized_layout(|_| -> Option<Size> { unreachable!("made once") }).unwrap();
    /// assert_eq!(again.0, 68);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn quantized_layout<T: QuantizedLayout>(
        &self,
        make: impl FnOnce(&QTensor) -> Option<T>,
    ) -> Option<Arc<T>> {
        self.quant_entry()?.layout(make)
    }

    /// Whether the parameter holds a quantized weight.
    #[inline]
    pub fn is_quantized(&self) -> bool {
        self.0.quant.is_on()
    }

    /// The kind of the quantized weight (`Q8_0`, …), or `None` for a float parameter. For a
    /// parameter with no values yet, the kind [`quantize`](Self::quantize) marked it to take when
    /// loaded ([`is_quantized`](Self::is_quantized) is `false` until then).
    pub fn quantized_dtype(&self) -> Option<GgmlDType> {
        (self.0.quant.entry().map(|e| e.kind())).or_else(|| self.0.quant.pending())
    }

    /// Drops the quantized weight: the parameter holds its values dequantized as floats again,
    /// `Linear` layers multiply with them, and it trains again unless it was frozen before. A
    /// no-op on a float parameter.
    ///
    /// ```
    /// use module_runtime::{Param, candle_core::{quantized::GgmlDType, Device, Tensor}};
    /// let w = Param::new(Tensor::randn(0f32, 1., (4, 64), &Device::Cpu)?)?;
    /// w.quantize(GgmlDType::Q8_0)?;
    /// let values = w.tensor()?; // dequantized, a fresh tensor
    /// w.dequantize()?;
    /// assert!(!w.is_quantized() && w.requires_grad());
    /// assert_eq!((w.tensor()? - values)?.abs()?.max_all()?.to_scalar::<f32>()?, 0.0);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn dequantize(&self) -> Result<()> {
        if !self.is_quantized() {
            // A parameter marked to be quantized when loaded is unmarked.
            atomic_update(|| self.0.quant.set_pending(None));
            return Ok(());
        }
        let values = Var::from_tensor(&self.own_tensor()?)?;
        atomic_update(|| {
            self.0.var.replace(values);
            self.0.quant.store(None);
        });
        Ok(())
    }

    /// Makes `weight` the parameter's value, its float values freed: the cell keeps an empty
    /// stand-in of `dtype` (built as the weight's shape when unbuilt; a built parameter must have
    /// that shape already).
    pub(crate) fn store_quantized(&self, weight: Arc<QTensor>, dtype: DType) -> Result<()> {
        let stand_in = Var::zeros(0, dtype, &self.0.var.device())?;
        atomic_update(|| self.store_locked(weight, stand_in, dtype))
    }

    /// [`store_quantized`](Self::store_quantized)'s writes, inside its update.
    fn store_locked(&self, weight: Arc<QTensor>, stand_in: Var, dtype: DType) -> Result<()> {
        let built = self
            .0
            .var
            .build_as(weight.shape().dims(), stand_in.clone())?;
        if !built && self.shape() != *weight.shape() {
            return Err(crate::Error::ValueMismatch {
                expected_shape: self.shape(),
                expected_dtype: self.dtype(),
                shape: weight.shape().clone(),
                dtype,
            });
        }
        // The weight first: a reader in between sees the new weight's values, never the
        // stand-in as the parameter's.
        self.0.quant.store(Some(weight));
        if !built {
            self.0.var.replace(stand_in);
        }
        Ok(())
    }

    /// The quantized weight moved to `device`, for a move that commits it afterwards (`None` when
    /// the parameter is not quantized).
    pub fn quant_on(&self, device: &Device) -> Result<Option<Arc<QTensor>>> {
        self.0
            .quant
            .entry()
            .map(|e| qtensor_on(&e.weight()?, device))
            .transpose()
    }

    /// Installs a quantized weight computed by [`quant_on`](Self::quant_on) (a model's move).
    pub fn replace_quant(&self, weight: Option<Arc<QTensor>>) {
        atomic_update(|| self.0.quant.store(weight));
    }

    /// [`set`](Self::set) and [`assign`](Self::assign) on a quantized parameter: `value`
    /// quantized to `kind` on the parameter's device, then taken, the parameter's dtype becoming
    /// `dtype` (its own for `set`, the value's for `assign`).
    pub(crate) fn set_requantized(
        &self,
        value: &Tensor,
        kind: GgmlDType,
        dtype: DType,
    ) -> Result<()> {
        let value = value.to_device(&self.0.var.device())?;
        let q = quantize_value(&value, kind)?;
        self.store_quantized(q, dtype)
    }
}

#[cfg(test)]
#[path = "quant_tests.rs"]
mod tests;
