//! GGUF files (llama.cpp's format): [`GgufFile`], its tensors (quantized or not) and metadata, and
//! their strict, all-or-nothing load into a model through a table of name rules, [`NameMap`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Shape};

use crate::buffer::Buffer;
use crate::error::{Error, Result};
use crate::module::Module;
use crate::param::Param;
use crate::report::{LoadReport, Mismatch};
use module_core::names::{named_buffers, named_parameters};
use module_core::{Names, QuantizeError};

/// A value of a GGUF file's metadata (candle's `gguf_file::Value`).
pub use candle_core::quantized::gguf_file::Value as GgufValue;

/// A table of rules that rename a file's tensors to model paths: llama.cpp's
/// `blk.N.attn_q.weight` to Hugging Face's `model.layers.N.self_attn.q_proj.weight`.
///
/// A rule's `from` is a dotted name in which a `*` segment matches any one segment; its `to`
/// puts the matched segments back, in order, where it has `*`. The first rule that matches a
/// name renames it; a name no rule matches is kept as it is (so a file with the model's own
/// names needs no rules).
///
/// ```
/// use module_runtime::NameMap;
/// let map = NameMap::new()
///     .rule("token_embd.weight", "model.embed_tokens.weight")
///     .rule("blk.*.attn_q.weight", "model.layers.*.self_attn.q_proj.weight");
/// assert_eq!(map.apply("blk.7.attn_q.weight"), "model.layers.7.self_attn.q_proj.weight");
/// assert_eq!(map.apply("token_embd.weight"), "model.embed_tokens.weight");
/// assert_eq!(map.apply("lm_head.weight"), "lm_head.weight"); // no rule: unchanged
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NameMap {
    rules: Vec<(Vec<String>, String)>,
}

impl NameMap {
    /// An empty table: every name is kept.
    pub fn new() -> Self {
        Self::default()
    }

    /// The table with one more rule, tried after the others.
    pub fn rule(mut self, from: &str, to: &str) -> Self {
        self.rules
            .push((from.split('.').map(str::to_owned).collect(), to.to_owned()));
        self
    }

    /// The model path of the file's `name`, if a rule matches it.
    pub fn map(&self, name: &str) -> Option<String> {
        let parts: Vec<&str> = name.split('.').collect();
        self.rules.iter().find_map(|(from, to)| {
            if from.len() != parts.len() {
                return None;
            }
            let mut captured = Vec::new();
            for (pattern, part) in from.iter().zip(&parts) {
                match pattern.as_str() {
                    "*" => captured.push(*part),
                    p if p == *part => {}
                    _ => return None,
                }
            }
            let mut captured = captured.into_iter();
            let out: Vec<String> = to
                .split('.')
                .map(|s| match s {
                    "*" => captured.next().unwrap_or("*").to_owned(),
                    s => s.to_owned(),
                })
                .collect();
            Some(out.join("."))
        })
    }

    /// The model path of `name`: [`map`](Self::map)'s, or `name` itself.
    pub fn apply(&self, name: &str) -> String {
        self.map(name).unwrap_or_else(|| name.to_owned())
    }
}

/// A GGUF file read into memory: its metadata and its tensors by the file's names, each a
/// candle [`QTensor`] (quantized, or `F32`/`F16`/`BF16`) on the device it was read to.
///
/// [`load_into`](Self::load_into) loads it into a model. A model package adds what its
/// architecture needs: `llama`'s `LlamaForCausalLM::from_gguf` reads the configuration from the
/// `llama.*` metadata and undoes the row order llama.cpp's converter gives `attn_q`/`attn_k`.
pub struct GgufFile {
    path: PathBuf,
    /// The metadata (`general.architecture`, `llama.block_count`, …).
    pub metadata: HashMap<String, GgufValue>,
    /// The tensors, by the file's names (`blk.0.attn_q.weight`).
    pub tensors: BTreeMap<String, QTensor>,
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
                let t = content.tensor(&mut reader, name, device).map_err(bad)?;
                Ok((name.clone(), t))
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

    /// Loads the tensors into `model`, each renamed by `map`, strictly and all or nothing: every
    /// parameter and persistent buffer of the model must get exactly one tensor of its shape, and
    /// every tensor must name one; otherwise [`Error::Load`] reports every missing, unexpected
    /// (after renaming) and misshapen entry at once, and the model is not changed. A tied weight
    /// is one entry, under its first path (llama.cpp's files hold no `output.weight` for a tied
    /// head).
    ///
    /// A quantized tensor becomes a quantized parameter ([`Param::set_quantized`]: `Linear`
    /// layers multiply with it, the parameter reads as its dequantized values); a float one is
    /// loaded as a plain value, converted to the parameter's dtype. Returns how many entries
    /// were loaded.
    pub fn load_into(self, model: &dyn Module, map: &NameMap) -> Result<usize> {
        enum Slot {
            Param(Param),
            Buffer(Buffer),
        }
        let mut slots: BTreeMap<String, Slot> = named_parameters(model, &Names::new())
            .into_iter()
            .map(|(k, p)| (k, Slot::Param(p)))
            .collect();
        for (k, b) in named_buffers(model, &Names::new()) {
            if b.is_persistent() {
                slots.insert(k, Slot::Buffer(b));
            }
        }
        let mut report = LoadReport::default();
        let mut found: BTreeMap<String, QTensor> = BTreeMap::new();
        for (name, q) in self.tensors {
            let key = map.apply(&name);
            let Some(slot) = slots.get(&key) else {
                report.unexpected.push(key);
                continue;
            };
            if found.contains_key(&key) {
                report
                    .unexpected
                    .push(format!("{key} (again, from `{name}`)"));
                continue;
            }
            let (shape, dtype, lazy) = match slot {
                Slot::Param(p) => (p.shape(), p.dtype(), p.lazy_shape()),
                Slot::Buffer(b) => (b.shape(), b.dtype(), b.lazy_shape()),
            };
            let fits = match &lazy {
                Some(lazy) => lazy.accepts(q.shape().dims()),
                None => shape == *q.shape(),
            };
            if !fits {
                report.mismatched.push(Mismatch {
                    key,
                    expected_shape: shape,
                    expected_dtype: dtype,
                    shape: q.shape().clone(),
                    dtype: float_dtype(q.dtype()),
                    unbuilt: lazy,
                });
                continue;
            }
            found.insert(key, q);
        }
        report.missing = slots
            .keys()
            .filter(|k| !found.contains_key(*k))
            .cloned()
            .collect();
        if !report.is_complete() {
            return Err(Error::Load(Box::new(report)));
        }
        let loaded = found.len();
        for (key, q) in found {
            match &slots[&key] {
                Slot::Param(p) => p.set_quantized(q)?,
                Slot::Buffer(b) => {
                    let t = q.dequantize(&b.device())?.to_dtype(b.dtype())?;
                    b.set(&t)?
                }
            }
        }
        Ok(loaded)
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
