//! Embedding tables.

use candle_core::{DType, Device, Tensor};

use crate::common::forward_by_value;
use crate::device::check_input_device;
use crate::error::Result;
use crate::Init;
use crate::{Forward, Module, Param};

/// A lookup table of `num_embeddings` vectors of size `embedding_dim`: PyTorch's `nn.Embedding`.
///
/// Parameter `weight` `[num_embeddings, embedding_dim]`, initialized from `N(0, 1)` as PyTorch
/// does. The input holds integer ids (`u8`, `u32` or `i64`) of any shape `[*]`; the output is
/// `[*, embedding_dim]`. The gradient of `weight` accumulates over repeated ids.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Embedding;
/// let emb = Embedding::new(10, 4, &Device::Cpu)?;
/// let ids = Tensor::new(&[[1i64, 2, 1], [0, 9, 3]], &Device::Cpu)?;
/// assert_eq!(emb.call(&ids)?.dims(), [2, 3, 4]);
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
}

/// How an [`Embedding`] is built: PyTorch's keyword arguments this layer supports, with PyTorch's
/// defaults (`padding_idx`, `max_norm` and sparse gradients are not supported).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EmbeddingConfig {
    /// The table's floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for EmbeddingConfig {
    fn default() -> Self {
        Self { dtype: DType::F32 }
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

    /// A table built as `config` says, initialized from `N(0, 1)`.
    pub fn with_config(
        num_embeddings: usize,
        embedding_dim: usize,
        config: EmbeddingConfig,
        device: &Device,
    ) -> Result<Self> {
        let normal = Init::Normal {
            mean: 0.0,
            std: 1.0,
        };
        let shape = (num_embeddings, embedding_dim);
        Ok(Self {
            weight: Param::init(shape, normal, 0, config.dtype, device)?,
        })
    }

    /// A table holding `weight` `[num_embeddings, embedding_dim]`.
    pub fn from_weight(weight: Tensor) -> Result<Self> {
        weight.dims2()?;
        Ok(Self {
            weight: Param::new(weight)?,
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
}

impl Forward<&Tensor> for Embedding {
    type Output = Tensor;

    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let weight = self.weight.tensor()?;
        check_input_device("Embedding.weight", &weight, ids)?;
        let rows = weight.index_select(&ids.flatten_all()?, 0)?;
        let mut dims = ids.dims().to_vec();
        dims.push(weight.dim(1)?);
        Ok(rows.reshape(dims)?)
    }
}

impl module_core::ExtraRepr for Embedding {
    fn extra_repr(&self) -> String {
        let dims = self.weight.shape().dims().to_vec();
        format!("{}, {}", dims[0], dims.get(1).copied().unwrap_or(0))
    }
}

forward_by_value!(Embedding);
