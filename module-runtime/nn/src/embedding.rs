//! Embedding tables, and what [`EmbeddingBag`](crate::EmbeddingBag) shares with them: the ids'
//! dtype check, `padding_idx` and the `max_norm` renormalisation.

use candle_core::{DType, Device, Tensor};
use module_core::py_float;

use crate::common::forward_by_value;
use crate::device::check_input_device;
use crate::error::{Error, Result};
use crate::peft::LoraLayer;
use crate::Init;
use crate::{Forward, Module, Param};

/// A lookup table of `num_embeddings` vectors of size `embedding_dim`: PyTorch's `nn.Embedding`.
///
/// Parameter `weight` `[num_embeddings, embedding_dim]`, initialized from `N(0, 1)` as PyTorch
/// does (with the `padding_idx` row zero). The input holds integer ids (`u8`, `u32` or `i64`) of
/// any shape `[*]`; the output is `[*, embedding_dim]`. The gradient of `weight` accumulates over
/// repeated ids, except at `padding_idx`, whose row gets no gradient (it stays what it is, zero
/// unless loaded otherwise). With `max_norm`, each call first rescales, in place, the rows it looks
/// up whose `norm_type`-norm exceeds `max_norm` (PyTorch's `embedding_renorm_`).
///
/// Ids of another dtype are an [`Error::InvalidInput`] ("ids must be an integer tensor (u8, u32 or
/// i64), got F32").
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{Embedding, EmbeddingConfig};
/// let emb = Embedding::new(10, 4, &Device::Cpu)?;
/// let ids = Tensor::new(&[[1i64, 2, 1], [0, 9, 3]], &Device::Cpu)?;
/// assert_eq!(emb.call(&ids)?.dims(), [2, 3, 4]);
///
/// let config = EmbeddingConfig { padding_idx: Some(0), ..Default::default() };
/// let padded = Embedding::with_config(10, 4, config, &Device::Cpu)?;
/// assert_eq!(padded.call(&Tensor::new(&[0u32], &Device::Cpu)?)?.to_vec2::<f32>()?, [[0.; 4]]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`EmbeddingPath`], from [`Embedding::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct Embedding {
    /// `[num_embeddings, embedding_dim]`.
    pub weight: Param,
    padding_idx: Option<usize>,
    max_norm: Option<f64>,
    norm_type: f64,
    /// LoRA adapters ([`get_peft_model`](crate::peft::get_peft_model)): `lora_embedding_A.<name>`
    /// and `lora_embedding_B.<name>`; none until an adapter is added.
    #[module(flatten)]
    pub(crate) lora: Option<Box<LoraLayer>>,
    /// PEFT's `modules_to_save` copies of the layer (`modules_to_save.<adapter>.weight`, …),
    /// used instead of it while their adapter is active; none until an adapter asks for them.
    #[module(flatten)]
    pub(crate) modules_to_save: Option<Box<crate::peft::ModulesToSave>>,
    /// Parametrizations ([`parametrize`](crate::parametrize)), flattened.
    #[module(flatten)]
    pub(crate) parametrizations: Option<Box<crate::parametrize::Parametrizations>>,
}

/// How an [`Embedding`] is built: PyTorch's keyword arguments this layer supports, with PyTorch's
/// defaults (`scale_grad_by_freq` and sparse gradients are not supported).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmbeddingConfig {
    /// The id whose row is zero at initialization and gets no gradient (default `None`). A
    /// negative index counts from the end, as in PyTorch (`-1` is the last row).
    pub padding_idx: Option<i64>,
    /// The largest norm a looked-up row may have: larger rows are rescaled to it, in place, when
    /// they are looked up (default `None`).
    pub max_norm: Option<f64>,
    /// The `p` of the p-norm `max_norm` bounds (default `2.0`).
    pub norm_type: f64,
    /// The table's floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for EmbeddingConfig {
    fn default() -> Self {
        Self {
            padding_idx: None,
            max_norm: None,
            norm_type: 2.0,
            dtype: DType::F32,
        }
    }
}

impl Embedding {
    /// A float32 table initialized from `N(0, 1)`.
    pub fn new(num_embeddings: usize, embedding_dim: usize, device: &Device) -> Result<Self> {
        Self::with_config(
            num_embeddings,
            embedding_dim,
            EmbeddingConfig::default(),
            device,
        )
    }

    /// A table built as `config` says, initialized from `N(0, 1)`, its `padding_idx` row zero.
    /// A `padding_idx` outside `[-num_embeddings, num_embeddings)` is an
    /// [`Error::InvalidConfig`].
    pub fn with_config(
        num_embeddings: usize,
        embedding_dim: usize,
        config: EmbeddingConfig,
        device: &Device,
    ) -> Result<Self> {
        let shape = (num_embeddings, embedding_dim);
        let (weight, padding_idx) =
            table("Embedding", shape, config.padding_idx, config.dtype, device)?;
        Ok(Self {
            weight,
            padding_idx,
            max_norm: config.max_norm,
            norm_type: config.norm_type,
            lora: None,
            modules_to_save: None,
            parametrizations: None,
        })
    }

    /// A table holding `weight` `[num_embeddings, embedding_dim]`, with PyTorch's defaults.
    pub fn from_weight(weight: Tensor) -> Result<Self> {
        weight.dims2()?;
        Ok(Self {
            weight: Param::new(weight)?,
            padding_idx: None,
            max_norm: None,
            norm_type: 2.0,
            lora: None,
            modules_to_save: None,
            parametrizations: None,
        })
    }

    /// Number of vectors in the table.
    pub fn num_embeddings(&self) -> usize {
        self.weight.shape().dims()[0]
    }

    /// Size of each vector.
    pub fn embedding_dim(&self) -> usize {
        self.weight.shape().dims()[1]
    }

    /// The padding row, as a non-negative index.
    pub fn padding_idx(&self) -> Option<usize> {
        self.padding_idx
    }
}

/// A table `[num_embeddings, embedding_dim]` from `N(0, 1)` with its `padding_idx` row zero (as
/// PyTorch's `reset_parameters`), and that index, checked and made non-negative.
pub(crate) fn table(
    layer: &'static str,
    (num_embeddings, embedding_dim): (usize, usize),
    padding_idx: Option<i64>,
    dtype: DType,
    device: &Device,
) -> Result<(Param, Option<usize>)> {
    let padding_idx = padding_index(layer, padding_idx, num_embeddings)?;
    let normal = Init::Normal {
        mean: 0.0,
        std: 1.0,
    };
    let weight = Param::init((num_embeddings, embedding_dim), normal, 0, dtype, device)?;
    if let Some(idx) = padding_idx {
        let table = weight.tensor()?;
        let row = Tensor::zeros((1, embedding_dim), dtype, device)?;
        table.slice_set(&row, 0, idx)?;
    }
    Ok((weight, padding_idx))
}

/// `padding_idx` as a row index (a negative one counts from the end), checked as PyTorch does.
fn padding_index(
    layer: &'static str,
    padding_idx: Option<i64>,
    num_embeddings: usize,
) -> Result<Option<usize>> {
    let Some(idx) = padding_idx else {
        return Ok(None);
    };
    let n = num_embeddings as i64;
    if !(-n..n).contains(&idx) {
        return Err(Error::InvalidConfig {
            layer,
            message: format!("padding_idx ({idx}) must be within num_embeddings ({n})"),
        });
    }
    Ok(Some(idx.rem_euclid(n) as usize))
}

/// Refuses ids that are not `u8`, `u32` or `i64` (candle's `index_select` would fail with
/// "unsupported dtype F32 for op index-select").
pub(crate) fn check_ids(layer: &'static str, what: &str, ids: &Tensor) -> Result<()> {
    match ids.dtype() {
        DType::U8 | DType::U32 | DType::I64 => Ok(()),
        dtype => Err(Error::InvalidInput {
            layer,
            message: format!("{what} must be an integer tensor (u8, u32 or i64), got {dtype:?}"),
        }),
    }
}

/// PyTorch's `embedding_renorm_`: every row of `table` that `ids` name and whose `p`-norm exceeds
/// `max_norm` is scaled, in place, by `max_norm / (norm + 1e-7)`. Outside the autograd graph.
pub(crate) fn renorm_rows(table: &Tensor, ids: &Tensor, max_norm: f64, p: f64) -> Result<()> {
    let mut unique: Vec<i64> = ids.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    unique.sort_unstable();
    unique.dedup();
    let rows = unique.len();
    let index = Tensor::from_vec(unique.clone(), rows, table.device())?;
    let values = table
        .detach()
        .index_select(&index, 0)?
        .to_dtype(DType::F64)?;
    let norms: Vec<f64> = match p {
        2.0 => values.sqr()?.sum(1)?.sqrt()?.to_vec1()?,
        1.0 => values.abs()?.sum(1)?.to_vec1()?,
        _ => {
            let powered = values.abs()?.powf(p)?.sum(1)?;
            powered.powf(1.0 / p)?.to_vec1()?
        }
    };
    for (row, (&id, norm)) in unique.iter().zip(norms).enumerate() {
        if norm > max_norm {
            let scaled = (values.narrow(0, row, 1)? * (max_norm / (norm + 1e-7)))?;
            table.slice_set(&scaled.to_dtype(table.dtype())?, 0, id as usize)?;
        }
    }
    Ok(())
}

/// `rows` (looked up for `ids`, `[*, D]`) with the rows of `padding_idx` detached, so that no
/// gradient reaches that row of the table. Only where a gradient is recorded.
pub(crate) fn detach_padding(
    rows: Tensor,
    ids: &Tensor,
    padding_idx: Option<usize>,
) -> Result<Tensor> {
    let Some(idx) = padding_idx.filter(|_| rows.track_op()) else {
        return Ok(rows);
    };
    let pad = Tensor::new(&[idx as i64], ids.device())?.to_dtype(ids.dtype())?;
    let is_pad = ids.broadcast_eq(&pad)?.unsqueeze(ids.rank())?;
    let is_pad = is_pad.broadcast_as(rows.shape())?;
    Ok(is_pad.where_cond(&rows.detach(), &rows)?)
}

/// The rows `ids` (any shape) of the quantized table `weight` `[rows, dim]`, dequantized to its
/// dtype: `[…ids, dim]`. Only those rows are read (from the weight, or the kernel's layout that
/// holds it); an id outside the table is [`Error::InvalidInput`].
fn quantized_rows(weight: &Param, ids: &Tensor) -> Result<Option<Tensor>> {
    let (rows, dim) = weight.shape().dims2()?;
    let wanted: Vec<i64> = ids.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
    let mut picked = Vec::with_capacity(wanted.len());
    for &id in &wanted {
        let Some(row) = usize::try_from(id).ok().filter(|&r| r < rows) else {
            return Err(Error::InvalidInput {
                layer: "Embedding",
                message: format!("id {id} is outside the table's {rows} rows"),
            });
        };
        picked.push(row);
    }
    let Some(q) = weight.quantized_rows(&picked)? else {
        return Ok(None);
    };
    let mut dims = ids.dims().to_vec();
    dims.push(dim);
    Ok(Some(
        q.dequantize(&Device::Cpu)?
            .to_dtype(weight.dtype())?
            .reshape(dims)?,
    ))
}

impl Forward<&Tensor> for Embedding {
    type Output = Tensor;

    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if let Some(y) = crate::peft::saved_forward(&self.modules_to_save, ids) {
            return y;
        }
        let rows = self.base_forward(ids)?;
        match &self.lora {
            // PEFT's `lora.Embedding`: the table's rows, plus the active adapter's.
            Some(lora) => lora.forward_embedding(self, ids, rows),
            None => Ok(rows),
        }
    }
}

impl Embedding {
    /// The adapter's `lora_embedding_A` looked up as this table's rows are (`padding_idx`'s row
    /// gets no gradient): PEFT's `_embed(x, lora_embedding_A.T)`. `a_t` is
    /// `[num_embeddings, r]`.
    pub(crate) fn lookup(&self, a_t: &Tensor, ids: &Tensor) -> Result<Tensor> {
        let rows = a_t.index_select(&ids.flatten_all()?, 0)?;
        let mut dims = ids.dims().to_vec();
        dims.push(a_t.dim(1)?);
        detach_padding(rows.reshape(dims)?, ids, self.padding_idx)
    }

    /// Whether the table renormalizes looked-up rows (`max_norm`), which an adapter's
    /// lookup cannot follow.
    pub(crate) fn has_max_norm(&self) -> bool {
        self.max_norm.is_some()
    }

    /// The table's LoRA adapters, if it has any
    /// ([`get_peft_model`](crate::peft::get_peft_model)).
    pub fn lora(&self) -> Option<&LoraLayer> {
        self.lora.as_deref()
    }

    /// The table without its adapters: PEFT's `base_layer(x)`.
    fn base_forward(&self, ids: &Tensor) -> Result<Tensor> {
        // A quantized table (tied to a quantized head, or a GGUF's `token_embd`): the rows named
        // are dequantized, not the table (which `tensor()` would dequantize whole). Off the CPU,
        // or with `max_norm` (which renormalizes rows of the table), the dequantized table.
        let gather = self.max_norm.is_none() && ids.device().is_cpu();
        if gather && self.weight.is_quantized() && self.weight.device().is_cpu() {
            check_ids("Embedding", "ids", ids)?;
            if let Some(rows) = quantized_rows(&self.weight, ids)? {
                return detach_padding(rows, ids, self.padding_idx);
            }
        }
        let rows = match self.scoped_rows(ids)? {
            Some(rows) => rows,
            None => {
                let weight = self.weight_value()?;
                check_input_device("Embedding.weight", &weight, ids)?;
                check_ids("Embedding", "ids", ids)?;
                check_range_off_cpu("Embedding", ids, weight.dims())?;
                if let Some(max_norm) = self.max_norm {
                    renorm_rows(&weight, ids, max_norm, self.norm_type)?;
                }
                weight
                    .index_select(&ids.flatten_all()?, 0)
                    .map_err(|e| ids_out_of_range("Embedding", ids, weight.dims(), e))?
            }
        };
        let mut dims = ids.dims().to_vec();
        dims.push(rows.dim(1)?);
        detach_padding(rows.reshape(dims)?, ids, self.padding_idx)
    }

    /// The rows `ids` as a functional scope that looks rows up itself gives them (a sharded
    /// table, [`Param::scoped_rows`]), `[ids, dim]`; `None` outside such a scope or with
    /// `max_norm` (which renormalizes rows of the table).
    fn scoped_rows(&self, ids: &Tensor) -> Result<Option<Tensor>> {
        if self.max_norm.is_some() || !module_core::scope::active() {
            return Ok(None);
        }
        check_ids("Embedding", "ids", ids)?;
        let table = self.weight.shape();
        self.weight
            .scoped_rows(&ids.flatten_all()?)
            .map_err(|e| ids_out_of_range("Embedding", ids, table.dims(), e))
    }
}

/// What a failed lookup in a `table` `[num_embeddings, dim]` means: an id outside
/// `0..num_embeddings` (found after the failure, so a lookup that succeeds pays nothing; candle
/// checks the ids on the CPU), said with the range and the fix, or candle's error as it is.
pub(crate) fn ids_out_of_range(
    layer: &'static str,
    ids: &Tensor,
    table: &[usize],
    error: impl Into<Error>,
) -> Error {
    range_error(layer, ids, table).unwrap_or_else(|| error.into())
}

/// Off the CPU, [`ids_out_of_range`]'s error before the lookup: candle's CUDA `index_select`
/// does not check its ids (an id past the table trips a device-side assertion, which leaves the
/// process's CUDA context unusable: found on an H200), where the CPU's refuses them. Two
/// reductions over the ids and two scalar reads per lookup there; nothing on the CPU.
pub(crate) fn check_range_off_cpu(
    layer: &'static str,
    ids: &Tensor,
    table: &[usize],
) -> Result<()> {
    if ids.device().is_cpu() || ids.elem_count() == 0 {
        return Ok(());
    }
    match range_error(layer, ids, table) {
        Some(error) => Err(error),
        None => Ok(()),
    }
}

/// [`Error::InvalidInput`] naming the range and the fix when an id of `ids` is outside
/// `0..table[0]`; `None` when every id is inside (or the extremes cannot be read).
fn range_error(layer: &'static str, ids: &Tensor, table: &[usize]) -> Option<Error> {
    let extreme = |t: candle_core::Result<Tensor>| -> Option<i64> {
        t.and_then(|t| t.to_dtype(DType::I64)?.to_scalar::<i64>())
            .ok()
    };
    let (Ok(flat), &[rows, dim]) = (ids.flatten_all(), table) else {
        return None;
    };
    let (min, max) = (extreme(flat.min(0))?, extreme(flat.max(0))?);
    let bad = if max >= rows as i64 { max } else { min };
    if min >= 0 && max < rows as i64 {
        return None;
    }
    Some(Error::InvalidInput {
        layer,
        message: format!(
            "ids must be in 0..{rows} (num_embeddings = {rows}), got {bad}: make the table \
             larger (`{layer}::new({}, {dim}, ..)`), or check that the ids come from the \
             vocabulary the model was made for",
            bad.max(0) + 1
        ),
    })
}

/// PyTorch's text of an embedding table's settings: `10, 3` (the table's shape), then each
/// setting that is not its default in PyTorch's order (`padding_idx`, between the shape and the
/// norm, only for [`Embedding`]).
pub(crate) fn table_repr(
    weight: &Param,
    padding_idx: Option<usize>,
    max_norm: Option<f64>,
    norm_type: f64,
) -> String {
    let dims = weight.shape().dims().to_vec();
    let mut s = format!("{}, {}", dims[0], dims.get(1).copied().unwrap_or(0));
    if let Some(idx) = padding_idx {
        s.push_str(&format!(", padding_idx={idx}"));
    }
    if let Some(max) = max_norm {
        s.push_str(&format!(", max_norm={}", py_float(max)));
    }
    if norm_type != 2.0 {
        s.push_str(&format!(", norm_type={}", py_float(norm_type)));
    }
    s
}

/// PyTorch's text: `Embedding(10, 3, padding_idx=0, max_norm=1.0)` (a negative `padding_idx`
/// shows as the row it resolved to, as in PyTorch); with adapters, PEFT's `lora.Embedding`.
impl module_core::ExtraRepr for Embedding {
    fn extra_repr(&self) -> String {
        let own = table_repr(
            &self.weight,
            self.padding_idx,
            self.max_norm,
            self.norm_type,
        );
        if let Some(saved) = &self.modules_to_save {
            return saved.wrapped_repr(&format!("Embedding({own})"));
        }
        match &self.lora {
            None => own,
            Some(lora) => lora.wrapped_repr(&format!("Embedding({own})")),
        }
    }

    fn child_repr(&self, child: &str) -> module_core::ChildRepr {
        crate::peft::adapter_child_repr(child)
    }

    fn class_repr(&self) -> Option<String> {
        let parametrized = self
            .parametrizations
            .as_ref()
            .map(|_| "ParametrizedEmbedding");
        let saved = self
            .modules_to_save
            .as_ref()
            .map(|_| "ModulesToSaveWrapper");
        let lora = self.lora.as_ref().map(|_| "lora.Embedding");
        (saved.or(lora).or(parametrized)).map(str::to_owned)
    }
}

forward_by_value!(Embedding);
