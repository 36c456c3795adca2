//! `EmbeddingBag`: sums, means or maxima of bags of embeddings, without the intermediate rows.

use candle_core::{DType, Device, Tensor};

use crate::common::forward_by_value;
use crate::device::check_input_device;
use crate::embedding::{check_ids, renorm_rows, table, table_repr};
use crate::error::{Error, Result};
use crate::{Forward, Module, Param};

/// How an [`EmbeddingBag`] reduces each bag: PyTorch's `mode`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum EmbeddingBagMode {
    /// The sum of the bag's rows (each times its `per_sample_weights`, if given).
    Sum,
    /// Their mean (PyTorch's default).
    #[default]
    Mean,
    /// Their elementwise maximum.
    Max,
}

/// How an [`EmbeddingBag`] is built: PyTorch's keyword arguments this layer supports, with
/// PyTorch's defaults (`scale_grad_by_freq` and sparse gradients are not supported).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EmbeddingBagConfig {
    /// See [`EmbeddingConfig::max_norm`](crate::EmbeddingConfig::max_norm) (default `None`).
    pub max_norm: Option<f64>,
    /// The `p` of the p-norm `max_norm` bounds (default `2.0`).
    pub norm_type: f64,
    /// The reduction over each bag (default [`EmbeddingBagMode::Mean`]).
    pub mode: EmbeddingBagMode,
    /// Whether `offsets` has one more entry than there are bags, the last being the end of the
    /// last bag (default `false`).
    pub include_last_offset: bool,
    /// The id whose entries are left out of every bag (not summed, not counted in a mean), whose
    /// row is zero at initialization and gets no gradient (default `None`; negative counts from the
    /// end).
    pub padding_idx: Option<i64>,
    /// The table's floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for EmbeddingBagConfig {
    fn default() -> Self {
        Self {
            max_norm: None,
            norm_type: 2.0,
            mode: EmbeddingBagMode::Mean,
            include_last_offset: false,
            padding_idx: None,
            dtype: DType::F32,
        }
    }
}

/// The arguments of an [`EmbeddingBag`] call: PyTorch's `forward(input, offsets=None,
/// per_sample_weights=None)`.
#[derive(Clone, Debug)]
pub struct BagInput {
    /// Integer ids: `[B, N]` (each row one bag of `N`), or `[N]` with `offsets`.
    pub input: Tensor,
    /// For a 1-D `input`: where each bag starts (`[B]`, the first `0`, non-decreasing; `[B + 1]`
    /// with `include_last_offset`). An empty bag gives zeros.
    pub offsets: Option<Tensor>,
    /// For mode `Sum`: one weight per id, shaped as `input`.
    pub per_sample_weights: Option<Tensor>,
}

impl BagInput {
    /// Bags that are the rows of a 2-D `input`.
    pub fn new(input: &Tensor) -> Self {
        Self {
            input: input.clone(),
            offsets: None,
            per_sample_weights: None,
        }
    }

    /// Bags of a 1-D `input` starting at `offsets`.
    pub fn with_offsets(input: &Tensor, offsets: &Tensor) -> Self {
        Self {
            offsets: Some(offsets.clone()),
            ..Self::new(input)
        }
    }

    /// Weights each id's row (mode `Sum` only).
    pub fn per_sample_weights(mut self, weights: &Tensor) -> Self {
        self.per_sample_weights = Some(weights.clone());
        self
    }
}

/// `input`, then `offsets` and `per_sample_weights` if present.
impl crate::TensorStruct for BagInput {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        f(&self.input);
        self.offsets
            .iter()
            .chain(&self.per_sample_weights)
            .for_each(f);
    }

    fn map_tensors(self, f: &mut dyn FnMut(Tensor) -> Tensor) -> Self {
        Self {
            input: f(self.input),
            offsets: self.offsets.map(&mut *f),
            per_sample_weights: self.per_sample_weights.map(f),
        }
    }

    fn clone_tree(&self) -> Option<Self> {
        Some(self.clone())
    }
}

/// Bags of embeddings reduced to one vector each: PyTorch's `nn.EmbeddingBag`.
///
/// Parameter `weight` `[num_embeddings, embedding_dim]`, from `N(0, 1)` (the `padding_idx` row
/// zero). The input is a [`BagInput`] (or a 2-D id tensor); the output is `[B, embedding_dim]`,
/// one row per bag: the sum, mean or maximum of the bag's rows ([`EmbeddingBagMode`]). Entries equal
/// to `padding_idx` are left out; an empty bag gives zeros.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{BagInput, EmbeddingBag, EmbeddingBagConfig, EmbeddingBagMode};
///
/// let dev = Device::Cpu;
/// let config = EmbeddingBagConfig { mode: EmbeddingBagMode::Sum, ..Default::default() };
/// let bag = EmbeddingBag::with_config(10, 3, config, &dev)?;
/// let ids = Tensor::new(&[1u32, 2, 4, 5, 4, 3, 2, 9], &dev)?;
/// let offsets = Tensor::new(&[0u32, 4], &dev)?; // two bags of four
/// assert_eq!(bag.call(BagInput::with_offsets(&ids, &offsets))?.dims(), [2, 3]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`EmbeddingBagPath`], from [`EmbeddingBag::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct EmbeddingBag {
    /// `[num_embeddings, embedding_dim]`.
    pub weight: Param,
    #[module(skip)]
    mode: EmbeddingBagMode,
    padding_idx: Option<usize>,
    include_last_offset: bool,
    max_norm: Option<f64>,
    norm_type: f64,
}

/// The kept entries of a call: their positions in `input`, their ids and their bags.
struct Bags {
    positions: Vec<u32>,
    ids: Vec<i64>,
    bag_of: Vec<u32>,
    count: usize,
}

impl EmbeddingBag {
    /// A float32 table with PyTorch's defaults (mode `Mean`).
    pub fn new(num_embeddings: usize, embedding_dim: usize, device: &Device) -> Result<Self> {
        Self::with_config(num_embeddings, embedding_dim, Default::default(), device)
    }

    /// A table built as `config` says, initialized from `N(0, 1)`, its `padding_idx` row zero.
    pub fn with_config(
        num_embeddings: usize,
        embedding_dim: usize,
        config: EmbeddingBagConfig,
        device: &Device,
    ) -> Result<Self> {
        let shape = (num_embeddings, embedding_dim);
        let (weight, padding_idx) = table(
            "EmbeddingBag",
            shape,
            config.padding_idx,
            config.dtype,
            device,
        )?;
        Ok(Self {
            weight,
            mode: config.mode,
            padding_idx,
            include_last_offset: config.include_last_offset,
            max_norm: config.max_norm,
            norm_type: config.norm_type,
        })
    }

    /// The reduction over each bag.
    pub fn mode(&self) -> EmbeddingBagMode {
        self.mode
    }

    /// Checks the call's arguments and splits the ids into bags, leaving out `padding_idx`.
    fn bags(&self, input: &BagInput) -> Result<Bags> {
        let invalid = |message: String| Error::InvalidInput {
            layer: "EmbeddingBag",
            message,
        };
        check_ids("EmbeddingBag", "input", &input.input)?;
        let ids: Vec<i64> = input.input.flatten_all()?.to_dtype(DType::I64)?.to_vec1()?;
        let n = ids.len();
        let starts: Vec<usize> = match (input.input.rank(), &input.offsets) {
            (2, None) => {
                let (b, len) = input.input.dims2()?;
                (0..b).map(|i| i * len).collect()
            }
            (1, Some(offsets)) => {
                check_ids("EmbeddingBag", "offsets", offsets)?;
                let mut starts: Vec<i64> = offsets.to_dtype(DType::I64)?.to_vec1()?;
                if self.include_last_offset {
                    starts.pop();
                }
                let ok = starts.first().is_none_or(|&s| s == 0)
                    && starts.windows(2).all(|w| w[0] <= w[1])
                    && starts.last().is_none_or(|&s| s as usize <= n);
                if !ok {
                    return Err(invalid(format!(
                        "offsets must start at 0 and not decrease nor pass the input's length {n}, got {starts:?}"
                    )));
                }
                starts.into_iter().map(|s| s as usize).collect()
            }
            (rank, offsets) => {
                let dims = input.input.dims();
                let with = if offsets.is_some() { "with" } else { "without" };
                return Err(invalid(format!(
                    "input must be 2-D [B, N] without offsets or 1-D [N] with offsets, got {dims:?} (rank {rank}) {with} offsets"
                )));
            }
        };
        let mut bags = Bags {
            positions: Vec::with_capacity(n),
            ids: Vec::with_capacity(n),
            bag_of: Vec::with_capacity(n),
            count: starts.len(),
        };
        for (bag, &start) in starts.iter().enumerate() {
            let end = starts.get(bag + 1).copied().unwrap_or(n);
            for (position, &id) in ids.iter().enumerate().take(end).skip(start) {
                if self.padding_idx != Some(id as usize) {
                    bags.positions.push(position as u32);
                    bags.ids.push(id);
                    bags.bag_of.push(bag as u32);
                }
            }
        }
        Ok(bags)
    }
}

impl Forward<BagInput> for EmbeddingBag {
    type Output = Tensor;

    fn forward(&self, input: BagInput) -> Result<Tensor> {
        let weight = self.weight.tensor()?;
        check_input_device("EmbeddingBag.weight", &weight, &input.input)?;
        if let Some(max_norm) = self.max_norm {
            check_ids("EmbeddingBag", "input", &input.input)?;
            renorm_rows(&weight, &input.input, max_norm, self.norm_type)?;
        }
        let bags = self.bags(&input)?;
        let (dev, k, d) = (weight.device(), bags.ids.len(), weight.dim(1)?);
        let rows = weight.index_select(&Tensor::new(bags.ids.as_slice(), dev)?, 0)?;
        let positions = Tensor::new(bags.positions.as_slice(), dev)?;
        let bag_of = Tensor::new(bags.bag_of.as_slice(), dev)?;
        let rows = match (&input.per_sample_weights, self.mode) {
            (None, _) => rows,
            (Some(w), EmbeddingBagMode::Sum) if w.dims() == input.input.dims() => {
                let w = w.flatten_all()?.index_select(&positions, 0)?;
                rows.broadcast_mul(&w.to_dtype(rows.dtype())?.reshape((k, 1))?)?
            }
            (Some(w), mode) => {
                let (got, dims) = (w.dims(), input.input.dims());
                return Err(Error::InvalidInput {
                    layer: "EmbeddingBag",
                    message: format!(
                        "per_sample_weights must be shaped as the input {dims:?} and the mode Sum, got {got:?} with mode {mode:?}"
                    ),
                });
            }
        };
        let zeros = Tensor::zeros((bags.count, d), rows.dtype(), dev)?;
        match self.mode {
            EmbeddingBagMode::Sum => Ok(zeros.index_add(&bag_of, &rows, 0)?),
            EmbeddingBagMode::Mean => {
                let mut counts = vec![0f32; bags.count];
                bags.bag_of.iter().for_each(|&b| counts[b as usize] += 1.0);
                let counts = counts.into_iter().map(|c| c.max(1.0)).collect::<Vec<_>>();
                let counts = Tensor::new(counts, dev)?.to_dtype(rows.dtype())?;
                let sums = zeros.index_add(&bag_of, &rows, 0)?;
                Ok(sums.broadcast_div(&counts.reshape((bags.count, 1))?)?)
            }
            EmbeddingBagMode::Max => {
                // The kept entries are in bag order: each bag is one run of rows.
                let mut out = Vec::with_capacity(bags.count);
                let mut start = 0;
                for bag in 0..bags.count as u32 {
                    let len = bags.bag_of[start..]
                        .iter()
                        .take_while(|&&b| b == bag)
                        .count();
                    out.push(match len {
                        0 => zeros.narrow(0, 0, 1)?,
                        _ => rows.narrow(0, start, len)?.max_keepdim(0)?,
                    });
                    start += len;
                }
                match out.is_empty() {
                    true => Ok(zeros),
                    false => Ok(Tensor::cat(&out, 0)?),
                }
            }
        }
    }
}

impl Forward<&Tensor> for EmbeddingBag {
    type Output = Tensor;

    /// Bags that are the rows of a 2-D input.
    fn forward(&self, input: &Tensor) -> Result<Tensor> {
        self.forward(BagInput::new(input))
    }
}

/// PyTorch's text: `EmbeddingBag(10, 3, max_norm=1.0, mode='sum', padding_idx=0)`.
impl module_core::ExtraRepr for EmbeddingBag {
    fn extra_repr(&self) -> String {
        let mut s = table_repr(&self.weight, None, self.max_norm, self.norm_type);
        let mode = match self.mode {
            EmbeddingBagMode::Sum => "sum",
            EmbeddingBagMode::Mean => "mean",
            EmbeddingBagMode::Max => "max",
        };
        s.push_str(&format!(", mode='{mode}'"));
        if let Some(idx) = self.padding_idx {
            s.push_str(&format!(", padding_idx={idx}"));
        }
        s
    }
}

forward_by_value!(EmbeddingBag);
