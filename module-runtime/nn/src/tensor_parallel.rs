//! Tensor parallelism for [`Linear`]: a layer keeps one rank's shard of its weight, split by
//! output rows (PyTorch's `ColwiseParallel`: the output is this rank's slice of features) or by
//! input columns (`RowwiseParallel`: the input is this rank's slice, the output a partial sum
//! that an all-reduce over the ranks completes). `module_runtime::parallelize_module` applies a
//! plan of these by path pattern with a process group's all-reduce; this file is the layer's side.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use candle_core::Tensor;

use crate::error::{Error, Result};
use crate::linear::Linear;
use crate::Param;

/// How a [`Linear`] is split over the ranks of a tensor-parallel group: PyTorch's
/// `torch.distributed.tensor.parallel` styles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ParallelStyle {
    /// `ColwiseParallel`: each rank keeps `out_features / world_size` rows of the weight (and of
    /// the bias); its output is its slice of the features, which the next layer takes as it is.
    Colwise,
    /// `RowwiseParallel`: each rank keeps `in_features / world_size` columns of the weight and
    /// takes its slice of the input features; the ranks' outputs are summed by an all-reduce
    /// after the product, the bias added once (rank 0 keeps it, the others a zero bias).
    Rowwise,
}

/// The all-reduce (sum, in place, over the group's ranks) a row-wise sharded [`Linear`] runs on
/// its output: a process group's `all_reduce(tensor, ReduceOp::Sum)`.
#[derive(Clone)]
pub struct OutputReduce(Arc<SumInPlace>);

/// An in-place sum of a tensor over the ranks.
type SumInPlace = dyn Fn(&Tensor) -> Result<()> + Send + Sync;

impl OutputReduce {
    /// The reduction `sum_in_place` (given a contiguous tensor, it overwrites it with the sum of
    /// every rank's tensor).
    pub fn new(sum_in_place: impl Fn(&Tensor) -> Result<()> + Send + Sync + 'static) -> Self {
        Self(Arc::new(sum_in_place))
    }

    /// `y` summed over the ranks (a fresh contiguous copy, reduced in place). Inference only: the
    /// reduction records no gradient, so a `y` that records one is [`Error::InvalidConfig`].
    pub(crate) fn apply(&self, y: Tensor) -> Result<Tensor> {
        if y.track_op() {
            return Err(Error::InvalidConfig {
                layer: "Linear",
                message: "a tensor-parallel Linear runs without gradients (inference: wrap the \
                          call in `no_grad`); its all-reduce is not differentiated"
                    .into(),
            });
        }
        let y = y.copy()?;
        (self.0)(&y)?;
        Ok(y)
    }
}

impl fmt::Debug for OutputReduce {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("OutputReduce(all_reduce sum)")
    }
}

impl Linear {
    /// Keeps the rows `rows` of the weight (output features; the bias likewise): one rank's
    /// shard of a [`ParallelStyle::Colwise`] layer, or any slice of heads (a replicated
    /// key/value head of grouped-query attention). The weight and bias become new parameters, so a
    /// weight tied elsewhere (an embedding) keeps its values there.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// let fc = Linear::new(4, 6, &Device::Cpu)?;
    /// let x = Tensor::randn(0f32, 1., (2, 4), &Device::Cpu)?;
    /// let full = fc.call(&x)?;
    /// let mut shard = fc.clone();
    /// shard.shard_rows(3..6)?;
    /// assert_eq!(shard.out_features(), 3);
    /// let part = shard.call(&x)?;
    /// assert_eq!(part.to_vec2::<f32>()?, full.narrow(1, 3, 3)?.to_vec2::<f32>()?);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn shard_rows(&mut self, rows: Range<usize>) -> Result<()> {
        self.check_shardable(0, &rows)?;
        let len = rows.end - rows.start;
        let weight = self.weight_value()?.narrow(0, rows.start, len)?;
        let bias = match &self.bias {
            Some(b) => Some(Param::new(b.tensor()?.narrow(0, rows.start, len)?.copy()?)?),
            None => None,
        };
        self.weight = Param::new(weight.copy()?)?;
        self.bias = bias;
        Ok(())
    }

    /// Keeps the columns `cols` of the weight (input features) and sums the ranks' outputs with
    /// `reduce` after each product: one rank's shard of a [`ParallelStyle::Rowwise`] layer.
    /// `keep_bias` says whether this rank adds the bias (one rank does; the others get a zero
    /// bias, so that the sum has it once).
    pub fn shard_cols(
        &mut self,
        cols: Range<usize>,
        keep_bias: bool,
        reduce: OutputReduce,
    ) -> Result<()> {
        self.check_shardable(1, &cols)?;
        let len = cols.end - cols.start;
        let weight = self.weight_value()?.narrow(1, cols.start, len)?;
        let bias = match &self.bias {
            Some(b) if keep_bias => Some(Param::new(b.tensor()?.copy()?)?),
            Some(b) => Some(Param::new(b.tensor()?.zeros_like()?)?),
            None => None,
        };
        self.weight = Param::new(weight.copy()?)?;
        self.bias = bias;
        self.reduce = Some(reduce);
        Ok(())
    }

    /// A plain, float, built layer whose dimension `dim` holds `range`.
    fn check_shardable(&self, dim: usize, range: &Range<usize>) -> Result<()> {
        let refuse = |why: &str| -> Result<()> {
            Err(Error::InvalidConfig {
                layer: "Linear",
                message: format!("cannot shard a Linear {why}"),
            })
        };
        if self.lora.is_some() || self.modules_to_save.is_some() {
            return refuse("that holds adapters: shard the base model first");
        }
        if self.parametrizations.is_some() {
            return refuse("with parametrizations");
        }
        if self.weight.is_quantized() {
            return refuse("whose weight is quantized: shard first, then quantize");
        }
        if self.reduce.is_some() {
            return refuse("that is sharded already");
        }
        let size = [self.out_features(), self.in_features()][dim];
        if range.start >= range.end || range.end > size {
            return refuse(&format!(
                "to {range:?} of its {} ({size})",
                ["out_features", "in_features"][dim]
            ));
        }
        Ok(())
    }
}

/// The part of `size` that `rank` of `world_size` keeps: an even split, or
/// [`Error::InvalidConfig`] naming `what` when `world_size` does not divide it.
pub fn even_shard(what: &str, size: usize, rank: usize, world_size: usize) -> Result<Range<usize>> {
    if world_size == 0 || rank >= world_size || !size.is_multiple_of(world_size) {
        return Err(Error::InvalidConfig {
            layer: "tensor parallel",
            message: format!(
                "{what} ({size}) does not split evenly over {world_size} ranks (rank {rank})"
            ),
        });
    }
    let part = size / world_size;
    Ok(rank * part..(rank + 1) * part)
}

/// One rank of a tensor-parallel group, as a plan needs it (PyTorch's one-dimensional
/// `DeviceMesh`): its rank, the group's size, and the group's all-reduce.
///
/// ```
/// use std::sync::Arc;
/// use module_runtime::distributed::{Collective, ReduceOp, SingleProcess};
/// use module_runtime::nn::{OutputReduce, TensorParallel};
/// let group: Arc<dyn Collective + Send + Sync> = Arc::new(SingleProcess);
/// let g = group.clone();
/// let mesh = TensorParallel::new(group.rank(), group.world_size(),
///     OutputReduce::new(move |t| g.all_reduce(t, ReduceOp::Sum)));
/// assert_eq!((mesh.rank, mesh.world_size), (0, 1));
/// ```
#[derive(Clone, Debug)]
pub struct TensorParallel {
    /// This process's rank in the group.
    pub rank: usize,
    /// The number of ranks the layers are split over.
    pub world_size: usize,
    /// The group's in-place sum of a tensor over its ranks.
    pub reduce: OutputReduce,
}

impl TensorParallel {
    /// Rank `rank` of `world_size`, summing with `reduce`.
    pub fn new(rank: usize, world_size: usize, reduce: OutputReduce) -> Self {
        Self {
            rank,
            world_size,
            reduce,
        }
    }
}

/// Splits the `Linear` layers of `model` over the ranks of `mesh` by a plan of path patterns
/// (`"layers.*.attn.q_proj"`, `"**.fc1"`) and styles, each layer taking the style of the first
/// pattern that matches its path: PyTorch's `parallelize_module(module, device_mesh,
/// parallelize_plan)` with `ColwiseParallel` and `RowwiseParallel`, evenly. Returns the paths
/// sharded, in module order.
///
/// The model's own code must fit the split, as with PyTorch: a column-wise layer's output holds
/// `1 / world_size` of the features (the heads of an attention split this way are this rank's
/// heads: set the module's head count accordingly), and a row-wise layer takes that slice and
/// returns the full sum. Inference only (`no_grad`, `without_grad`): the all-reduce is not
/// differentiated.
///
/// All or nothing: a pattern that matches no `Linear`, a dimension that does not split evenly,
/// or a layer that cannot be sharded (quantized, with adapters or parametrizations) is
/// [`Error::InvalidConfig`] before any layer changes.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{parallelize_module, OutputReduce, ParallelStyle, TensorParallel};
///
/// #[derive(Module, Clone)]
/// struct Mlp { up: Linear, down: Linear }
/// impl Forward<&Tensor> for Mlp {
///     type Output = Tensor;
///     fn forward(&self, x: &Tensor) -> module_runtime::Result<Tensor> {
///         self.down.call(&self.up.call(x)?.relu()?)
///     }
/// }
///
/// let dev = Device::Cpu;
/// let full = Mlp { up: Linear::new(4, 8, &dev)?, down: Linear::new(8, 4, &dev)? };
/// let x = Tensor::randn(0f32, 1., (2, 4), &dev)?;
/// let want = module_runtime::without_grad(|| full.call(&x))?;
/// // Two ranks, here one after the other: each keeps half of `up`'s rows and of `down`'s
/// // columns; the "all-reduce" adds the other rank's partial output.
/// let plan = [("up", ParallelStyle::Colwise), ("down", ParallelStyle::Rowwise)];
/// let mut partial = Vec::new();
/// for rank in 0..2 {
///     let mut shard = full.clone();
///     let mesh = TensorParallel::new(rank, 2, OutputReduce::new(|_| Ok(())));
///     assert_eq!(parallelize_module(&mut shard, &mesh, &plan)?, ["up", "down"]);
///     partial.push(module_runtime::without_grad(|| shard.call(&x))?);
/// }
/// let got = (&partial[0] + &partial[1])?;
/// assert!((got - want)?.abs()?.max_all()?.to_scalar::<f32>()? < 1e-6);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn parallelize_module(
    model: &mut dyn crate::Module,
    mesh: &TensorParallel,
    plan: &[(&str, ParallelStyle)],
) -> Result<Vec<String>> {
    use module_core::names::named_modules;
    use module_core::{Names, PathPattern};
    let patterns = (plan.iter())
        .map(|(p, style)| Ok((PathPattern::new(p)?, *style)))
        .collect::<Result<Vec<_>>>()?;
    let mut matched = vec![false; plan.len()];
    let mut staged: Vec<(String, Linear)> = Vec::new();
    for (path, module) in named_modules(model, &Names::new()) {
        let Some(linear) = module.downcast_ref::<Linear>() else {
            continue;
        };
        let Some(i) = patterns.iter().position(|(p, _)| p.matches(&path)) else {
            continue;
        };
        matched[i] = true;
        let mut shard = linear.clone();
        let (rank, world) = (mesh.rank, mesh.world_size);
        let named = |e: Error| Error::InvalidConfig {
            layer: "parallelize_module",
            message: format!("`{path}`: {e}"),
        };
        match patterns[i].1 {
            ParallelStyle::Colwise => {
                let rows = even_shard("out_features", shard.out_features(), rank, world);
                shard.shard_rows(rows.map_err(named)?).map_err(named)?;
            }
            ParallelStyle::Rowwise => {
                let cols = even_shard("in_features", shard.in_features(), rank, world);
                let cols = cols.map_err(named)?;
                (shard.shard_cols(cols, rank == 0, mesh.reduce.clone())).map_err(named)?;
            }
        }
        staged.push((path, shard));
    }
    if let Some(i) = matched.iter().position(|m| !m) {
        return Err(Error::InvalidConfig {
            layer: "parallelize_module",
            message: format!("the plan's pattern `{}` matches no Linear", plan[i].0),
        });
    }
    let mut paths = Vec::with_capacity(staged.len());
    for (path, shard) in staged {
        let module = module_core::path::submodule_mut(model, &path)?;
        if let Some(linear) = module.downcast_mut::<Linear>() {
            *linear = shard;
        }
        paths.push(path);
    }
    Ok(paths)
}
