//! GGUF files (llama.cpp's format): [`GgufFile`], its tensors (quantized or not) and metadata, a
//! checkpoint source like any other: loaded by `load_state_dict` (strict, all or nothing, key
//! rules such as [`LoadOptions::rename_key`](crate::LoadOptions::rename_key)), its quantized
//! tensors becoming quantized parameters.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};
use crate::state::Source;

mod header;
#[cfg(test)]
mod tests;
use module_core::quant::is_float_kind;
use module_core::QuantizeError;

/// A value of a GGUF file's metadata (candle's `gguf_file::Value`).
pub use candle_core::quantized::gguf_file::Value as GgufValue;

/// A GGUF file read into memory: its metadata and its tensors by the file's names, each a
/// candle [`QTensor`] (quantized, or `F32`/`F16`/`BF16`) on the device it was read to.
///
/// It loads into a model as any checkpoint does, through
/// [`load_state_dict`](../module_runtime/trait.ModuleExt.html#method.load_state_dict) — given
/// as `&file`, or as the file's path (read on the CPU) — with the same strict, all-or-nothing
/// checks and key rules: llama.cpp names tensors its own way, so the load's options rename
/// them ([`LoadOptions::rename_key`](crate::LoadOptions::rename_key)). A quantized tensor
/// becomes a quantized parameter ([`Param::set_quantized`](module_core::Param::set_quantized):
/// `Linear` layers multiply with it; the parameter reads as its dequantized values); a float one
/// (and any tensor loaded into a buffer) is loaded as a plain value, converted to the slot's
/// dtype. [`StateDict::read`](crate::StateDict::read) reads the tensors dequantized.
///
/// A model package adds what its architecture needs: `llama`'s `LlamaForCausalLM::from_gguf`
/// reads the configuration from the `llama.*` metadata and undoes the row order llama.cpp's
/// converter gives `attn_q`/`attn_k` before loading.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::{GgufFile, LoadOptions};
/// # let dir = std::env::temp_dir().join(format!("gguf-doc-{}", std::process::id()));
/// # std::fs::create_dir_all(&dir)?;
/// # let path = dir.join("fc.gguf");
/// # {
/// #     use module_runtime::candle_core::quantized::{gguf_file, GgmlDType, QTensor};
/// #     let w = QTensor::quantize(&Tensor::randn(0f32, 1., (4, 64), &Device::Cpu)?, GgmlDType::Q8_0)?;
/// #     let b = QTensor::quantize(&Tensor::zeros(4, DType::F32, &Device::Cpu)?, GgmlDType::F32)?;
/// #     let mut out = std::fs::File::create(&path)?;
/// #     gguf_file::write(&mut out, &[], &[("fc.weight", &w), ("fc.bias", &b)])?;
/// # }
/// let model = Linear::new(64, 4, &Device::Cpu)?;
/// let file = GgufFile::read(&path, &Device::Cpu)?; // tensors `fc.weight`, `fc.bias`
/// model.load_state_dict(&file, &LoadOptions::default().strip_prefix("fc"))?;
/// assert_eq!(model.weight.quantized_dtype(), Some(GgmlDType::Q8_0));
/// # std::fs::remove_dir_all(&dir)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct GgufFile {
    path: PathBuf,
    /// The metadata (`general.architecture`, `llama.block_count`, …).
    pub metadata: HashMap<String, GgufValue>,
    /// The tensors, by the file's names (`blk.0.attn_q.weight`).
    pub tensors: BTreeMap<String, Arc<QTensor>>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Reads the GGUF file at `path`, its tensors onto `device`.
    ///
    /// The reader is bounded: the header (metadata and tensor table) is checked whole before any
    /// tensor is read — every count and length against the rest of the file, the metadata's
    /// memory (metadata and tensor table) against a small multiple of the file's size, `general.alignment` a power of two,
    /// names unique, each tensor's size from its type and shape, and the tensors' data back to
    /// back on the alignment with nothing unaccounted between or after them (as llama.cpp
    /// writes and reads them) — so a file never makes it allocate much more than its own size.
    /// A file it refuses is [`QuantizeError::GgufFile`] naming the file and, in its
    /// [`GgufErrorKind`](module_core::GgufErrorKind), the key or tensor; a file that cannot be
    /// opened is [`Error::Io`].
    pub fn read(path: impl AsRef<Path>, device: &Device) -> Result<Self> {
        let path = path.as_ref().to_owned();
        let (metadata, tensors) = header::read_file(&path, device)?;
        let tensors = tensors
            .into_iter()
            .map(|(name, t)| (name, Arc::new(t)))
            .collect();
        Ok(Self {
            path,
            metadata,
            tensors,
        })
    }

    /// The file it was read from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata entry `key`, or [`QuantizeError::Gguf`] naming it.
    pub fn get(&self, key: &str) -> Result<&GgufValue> {
        self.metadata
            .get(key)
            .ok_or_else(|| self.error(format!("no metadata entry `{key}`")))
    }

    /// The integer metadata entry `key` (of any integer type).
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.get(key)?;
        header::as_u64(v)
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| self.error(format!("`{key}` is {v:?}, not a size")))
    }

    /// The float metadata entry `key` (`F32` or `F64`). An `F32` reads as the shortest decimal
    /// that is that float (`1e-6`, not `9.99999997e-7`): the value it was written from.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        match self.get(key)? {
            GgufValue::F32(x) => Ok(x.to_string().parse().unwrap_or(*x as f64)),
            GgufValue::F64(x) => Ok(*x),
            v => Err(self.error(format!("`{key}` is {v:?}, not a float"))),
        }
    }

    /// A [`QuantizeError::Gguf`] about this file.
    pub fn error(&self, reason: String) -> Error {
        QuantizeError::Gguf {
            file: self.path.clone(),
            reason,
        }
        .into()
    }
}

impl Source for GgufFile {
    fn entries(&self) -> Result<Vec<(String, Shape, DType)>> {
        Ok(self
            .tensors
            .iter()
            .map(|(name, q)| (name.clone(), q.shape().clone(), float_dtype(q.dtype())))
            .collect())
    }

    fn load(&self, key: &str, device: &Device) -> Result<Tensor> {
        let q = self.tensor(key)?;
        Ok(q.dequantize(device)?.to_dtype(float_dtype(q.dtype()))?)
    }

    fn load_quantized(&self, key: &str) -> Result<Option<Arc<QTensor>>> {
        let q = self.tensor(key)?;
        Ok((!is_float_kind(q.dtype())).then(|| q.clone()))
    }
}

impl GgufFile {
    fn tensor(&self, key: &str) -> Result<&Arc<QTensor>> {
        self.tensors
            .get(key)
            .ok_or_else(|| self.error(format!("no tensor `{key}`")))
    }
}

/// The float dtype a GGUF tensor reads as (quantized ones dequantize to `F32`).
fn float_dtype(kind: GgmlDType) -> DType {
    match kind {
        GgmlDType::F16 => DType::F16,
        GgmlDType::BF16 => DType::BF16,
        _ => DType::F32,
    }
}

/// Reorders the rows of `q` (a matrix `[rows, cols]`, quantized or not): row `i` of the result is
/// row `order[i]` of `q`. Quantized blocks run along a row, so rows move as whole bytes and the
/// values are unchanged (no requantization).
///
/// ```
/// use module_runtime::permute_rows;
/// use module_runtime::candle_core::{quantized::{GgmlDType, QTensor}, Device, Tensor};
/// let t = Tensor::arange(0f32, 96., &Device::Cpu)?.reshape((3, 32))?;
/// let q = QTensor::quantize(&t, GgmlDType::Q8_0)?;
/// let p = permute_rows(&q, &[2, 0, 1])?;
/// let (a, b) = (q.dequantize(&Device::Cpu)?, p.dequantize(&Device::Cpu)?);
/// assert_eq!(b.get(0)?.to_vec1::<f32>()?, a.get(2)?.to_vec1::<f32>()?);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn permute_rows(q: &QTensor, order: &[usize]) -> Result<QTensor> {
    let (rows, cols) = q.shape().dims2()?;
    let kind = q.dtype();
    let row_bytes = cols / kind.block_size() * kind.type_size();
    let data = q.data()?;
    let wrong = || Error::InvalidConfig {
        layer: "permute_rows",
        message: format!("an order of {} rows for a matrix of {rows}", order.len()),
    };
    if order.len() != rows || data.len() != rows * row_bytes {
        return Err(wrong());
    }
    let mut out = Vec::with_capacity(data.len());
    for &r in order {
        if r >= rows {
            return Err(wrong());
        }
        out.extend_from_slice(&data[r * row_bytes..(r + 1) * row_bytes]);
    }
    let storage = candle_core::quantized::QStorage::from_data(
        std::borrow::Cow::Owned(out),
        &q.device(),
        kind,
    )?;
    Ok(QTensor::new(storage, Shape::from((rows, cols)))?)
}
