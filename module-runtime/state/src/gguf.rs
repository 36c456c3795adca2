//! GGUF files (llama.cpp's format): [`GgufFile`], its tensors (quantized or not) and metadata, a
//! checkpoint source like any other: loaded by `load_state_dict` (strict, all or nothing, key
//! rules such as [`LoadOptions::rename_key`](crate::LoadOptions::rename_key)), its quantized
//! tensors becoming quantized parameters.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Shape, Tensor};

use crate::error::{Error, Result};
use crate::state::Source;
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
    /// Reads the GGUF file at `path`, its tensors onto `device`. A malformed or truncated file is
    /// [`Error::Checkpoint`] naming it.
    pub fn read(path: impl AsRef<Path>, device: &Device) -> Result<Self> {
        let path = path.as_ref().to_owned();
        let bad = |e: candle_core::Error| Error::Checkpoint {
            path: path.clone(),
            reason: format!("not a readable GGUF file: {e}"),
        };
        let mut file = std::fs::File::open(&path).map_err(|source| Error::Io {
            path: path.clone(),
            source,
        })?;
        let mut reader = std::io::BufReader::new(&mut file);
        let content = gguf_file::Content::read(&mut reader).map_err(bad)?;
        let mut names: Vec<&String> = content.tensor_infos.keys().collect();
        names.sort();
        let tensors = names
            .into_iter()
            .map(|name| {
                // Candle multiplies the dimensions unchecked: a crafted shape whose element count
                // overflows would read as a tensor of that shape over a few bytes.
                let info = &content.tensor_infos[name];
                let dims = info.shape.dims();
                let kind = info.ggml_dtype;
                let bytes = dims
                    .iter()
                    .try_fold(1usize, |n, &d| n.checked_mul(d))
                    .filter(|n| n % kind.block_size() == 0)
                    .and_then(|n| (n / kind.block_size()).checked_mul(kind.type_size()));
                let Some(bytes) = bytes else {
                    return Err(Error::Checkpoint {
                        path: path.clone(),
                        reason: format!("tensor `{name}`: {kind:?} of shape {dims:?} has no size"),
                    });
                };
                let t = content.tensor(&mut reader, name, device).map_err(bad)?;
                if t.storage_size_in_bytes() != bytes {
                    return Err(Error::Checkpoint {
                        path: path.clone(),
                        reason: format!("tensor `{name}`: {bytes} bytes expected for {dims:?}"),
                    });
                }
                Ok((name.clone(), Arc::new(t)))
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            path,
            metadata: content.metadata,
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
        let n = match v {
            GgufValue::U8(n) => Some(*n as u64),
            GgufValue::U16(n) => Some(*n as u64),
            GgufValue::U32(n) => Some(*n as u64),
            GgufValue::U64(n) => Some(*n),
            GgufValue::I8(n) => u64::try_from(*n).ok(),
            GgufValue::I16(n) => u64::try_from(*n).ok(),
            GgufValue::I32(n) => u64::try_from(*n).ok(),
            GgufValue::I64(n) => u64::try_from(*n).ok(),
            _ => None,
        };
        n.and_then(|n| usize::try_from(n).ok())
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;

    /// Reads `bytes` as a GGUF file (written to a file of this test's own).
    fn read(bytes: &[u8], name: &str) -> Result<GgufFile> {
        let path = std::env::temp_dir().join(format!("gguf-{name}-{}.gguf", std::process::id()));
        std::fs::write(&path, bytes).unwrap();
        let file = GgufFile::read(&path, &Device::Cpu);
        std::fs::remove_file(&path).unwrap();
        file
    }

    /// A valid file: one `q8_0` matrix and one float vector.
    fn valid() -> Vec<u8> {
        let dev = Device::Cpu;
        let w = Tensor::arange(0f32, 128., &dev)
            .unwrap()
            .reshape((2, 64))
            .unwrap();
        let w = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
        let b = QTensor::quantize(&Tensor::ones(2, DType::F32, &dev).unwrap(), GgmlDType::F32);
        let mut out = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut out, &[], &[("w", &w), ("b", &b.unwrap())]).unwrap();
        out.into_inner()
    }

    #[test]
    fn truncated_files_are_errors_that_name_the_file() {
        let bytes = valid();
        assert_eq!(read(&bytes, "whole").unwrap().tensors.len(), 2);
        // The writer pads the data to 32-byte alignment: a cut into that padding alone loses
        // nothing; any other cut is an error.
        let data_end = (0..=bytes.len())
            .rev()
            .take_while(|&cut| read(&bytes[..cut], "cut").is_ok())
            .last()
            .unwrap();
        assert!(bytes.len() - data_end < 32, "{data_end} of {}", bytes.len());
        for cut in 0..data_end {
            let Err(err) = read(&bytes[..cut], "cut") else {
                panic!("a file cut at {cut} of {} bytes was read", bytes.len())
            };
            assert!(err.to_string().contains("gguf-cut"), "{err}");
        }
    }

    #[test]
    fn a_shape_whose_size_overflows_is_an_error() {
        // Header: magic, version 3, one tensor, no metadata; the tensor `t`: 2 dims of 2^40
        // (2^80 elements: the product wraps to 0), F32, at offset 0.
        let mut bytes = b"GGUF".to_vec();
        for v in [
            3u32.to_le_bytes().to_vec(),
            1u64.to_le_bytes().to_vec(),
            0u64.to_le_bytes().to_vec(),
        ] {
            bytes.extend(v);
        }
        bytes.extend(1u64.to_le_bytes());
        bytes.extend(b"t");
        bytes.extend(2u32.to_le_bytes());
        bytes.extend((1u64 << 40).to_le_bytes());
        bytes.extend((1u64 << 40).to_le_bytes());
        bytes.extend(0u32.to_le_bytes()); // F32
        bytes.extend(0u64.to_le_bytes());
        bytes.resize(bytes.len().next_multiple_of(32), 0);
        let err = read(&bytes, "overflow").unwrap_err();
        assert!(err.to_string().contains("tensor `t`"), "{err}");
    }
}
