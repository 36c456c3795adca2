//! `AdaptiveLogSoftmaxWithLoss`: the efficient softmax of Grave et al. (2017) for large
//! vocabularies, PyTorch's `torch.nn` class of that name, with its parameters and names.

use candle_core::{DType, Device, Tensor};

use crate::activation::log_softmax;
use crate::common::input_shape_error;
use crate::error::{Error, Result};
use crate::{Forward, Module, ModuleExt};
use crate::{Linear, LinearConfig, ModuleList, Sequential};

/// How an [`AdaptiveLogSoftmaxWithLoss`] is built: PyTorch's keyword arguments, with PyTorch's
/// defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdaptiveLogSoftmaxConfig {
    /// Each cluster's projection is `div_value` times narrower than the previous one's, the first
    /// `in_features / div_value` (default 4.0).
    pub div_value: f64,
    /// Whether the head has a bias (default `false`).
    pub head_bias: bool,
}

impl Default for AdaptiveLogSoftmaxConfig {
    fn default() -> Self {
        Self {
            div_value: 4.0,
            head_bias: false,
        }
    }
}

/// The log-probability of each target and the mean negative log-likelihood, for frequent classes
/// in a head and rare ones in clusters of reduced size: PyTorch's
/// `nn.AdaptiveLogSoftmaxWithLoss(in_features, n_classes, cutoffs, div_value=4.0,
/// head_bias=False)`.
///
/// Classes below `cutoffs[0]` are the shortlist, scored by `head` together with one logit per
/// cluster; cluster `i` holds classes `cutoffs[i]..cutoffs[i + 1]` (the last ends at `n_classes`)
/// and scores them through `tail.i`, a projection to `in_features / div_value^(i + 1)` features
/// and a classifier. The parameters are PyTorch's: `head.weight` (and `head.bias`),
/// `tail.{i}.0.weight`, `tail.{i}.1.weight`, with `nn.Linear`'s initialization.
///
/// Called with `(input [N, in_features], target [N])` (or `[in_features]` and `[]`), it returns
/// `(output, loss)` as PyTorch's `_ASMoutput`: `output` `[N]` the log-probability of each target,
/// `loss` their mean negative. The targets are read back to the host to route each row to its
/// cluster, as PyTorch's boolean masks do. [`log_prob`](Self::log_prob) gives every class's
/// log-probability, [`predict`](Self::predict) the most likely class.
///
/// Typed paths into it: [`AdaptiveLogSoftmaxWithLossPath`], from
/// [`AdaptiveLogSoftmaxWithLoss::path`] (`#[module(paths)]`).
#[derive(Module, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct AdaptiveLogSoftmaxWithLoss {
    /// The shortlist's and the clusters' logits: `in_features` to `cutoffs[0] + clusters`.
    pub head: Linear,
    /// One projection and classifier per cluster.
    pub tail: ModuleList<Sequential>,
    /// The class boundaries, `n_classes` last (PyTorch's `self.cutoffs`).
    #[module(skip)]
    pub cutoffs: Vec<usize>,
}

impl AdaptiveLogSoftmaxWithLoss {
    /// A float32 adaptive softmax with PyTorch's defaults (`div_value = 4`, no head bias).
    pub fn new(
        in_features: usize,
        n_classes: usize,
        cutoffs: &[usize],
        device: &Device,
    ) -> Result<Self> {
        let config = AdaptiveLogSoftmaxConfig::default();
        Self::with_config(in_features, n_classes, cutoffs, config, device)
    }

    /// Built as `config` says. `cutoffs` must be increasing, unique and within `1..n_classes`,
    /// else an [`Error::InvalidConfig`], as PyTorch raises.
    pub fn with_config(
        in_features: usize,
        n_classes: usize,
        cutoffs: &[usize],
        config: AdaptiveLogSoftmaxConfig,
        device: &Device,
    ) -> Result<Self> {
        let AdaptiveLogSoftmaxConfig {
            div_value,
            head_bias,
        } = config;
        let increasing = cutoffs.windows(2).all(|w| w[0] < w[1]);
        let in_range = cutoffs.iter().all(|&c| c >= 1 && c < n_classes);
        if cutoffs.is_empty() || !increasing || !in_range {
            return Err(Error::InvalidConfig {
                layer: "AdaptiveLogSoftmaxWithLoss",
                message: format!(
                    "cutoffs should be a sequence of unique, positive integers sorted in an \
                     increasing order, where each value is between 1 and n_classes-1 = {}, got \
                     {cutoffs:?}",
                    n_classes.saturating_sub(1)
                ),
            });
        }
        let mut bounds = cutoffs.to_vec();
        bounds.push(n_classes);
        let clusters = bounds.len() - 1;
        let head_config = LinearConfig {
            bias: head_bias,
            ..Default::default()
        };
        let head = Linear::with_config(in_features, bounds[0] + clusters, head_config, device)?;
        let mut tail = ModuleList::new();
        for i in 0..clusters {
            let hidden = (in_features as f64 / div_value.powi(i as i32 + 1)).floor() as usize;
            let size = bounds[i + 1] - bounds[i];
            tail.push(
                Sequential::new()
                    .add(Linear::no_bias(in_features, hidden, device)?)
                    .add(Linear::no_bias(hidden, size, device)?),
            );
        }
        Ok(Self {
            head,
            tail,
            cutoffs: bounds,
        })
    }

    /// The number of classes.
    pub fn n_classes(&self) -> usize {
        self.cutoffs.last().copied().unwrap_or(0)
    }

    /// The log-probability of every class, `[N, n_classes]`, for `input` `[N, in_features]`.
    pub fn log_prob(&self, input: &Tensor) -> Result<Tensor> {
        let head = log_softmax(&self.head.call(input)?, 1)?;
        let shortlist = self.cutoffs[0];
        let mut parts = vec![head.narrow(1, 0, shortlist)?];
        for (i, cluster) in self.tail.iter().enumerate() {
            let local = log_softmax(&cluster.call(input)?, 1)?;
            parts.push(local.broadcast_add(&head.narrow(1, shortlist + i, 1)?)?);
        }
        Ok(Tensor::cat(&parts, 1)?)
    }

    /// The most likely class of each row of `input` `[N, in_features]`, as `u32` `[N]`.
    pub fn predict(&self, input: &Tensor) -> Result<Tensor> {
        Ok(self.log_prob(input)?.argmax(1)?)
    }
}

impl Forward<(&Tensor, &Tensor)> for AdaptiveLogSoftmaxWithLoss {
    type Output = (Tensor, Tensor);

    fn forward(&self, (input, target): (&Tensor, &Tensor)) -> Result<(Tensor, Tensor)> {
        const LAYER: &str = "AdaptiveLogSoftmaxWithLoss";
        let batched = target.rank() == 1;
        let fits = match (target.rank(), input.rank()) {
            (1, 2) => input.dim(0)? == target.dim(0)?,
            (0, 1) => true,
            _ => false,
        };
        if !fits || target.dtype().is_float() {
            let expected = format!(
                "[N, in_features] with integer targets [N] (or [in_features] with []), for the \
                 targets {:?}",
                target.dims()
            );
            return Err(input_shape_error(LAYER, expected, input));
        }
        let (x, t) = if batched {
            (input.clone(), target.clone())
        } else {
            (input.unsqueeze(0)?, target.unsqueeze(0)?)
        };
        let classes = host_classes(&t)?;
        let n_classes = self.n_classes();
        if let Some(&bad) = classes.iter().find(|&&c| c < 0 || c as usize >= n_classes) {
            let expected = format!("target class ids in [0, {n_classes}), got {bad}");
            return Err(input_shape_error(LAYER, expected, target));
        }
        let shortlist = self.cutoffs[0];
        // Each row's logit in the head: its class, or its cluster's slot.
        let mut head_ids = Vec::with_capacity(classes.len());
        // Contiguous: candle's GPU `index_add` takes no strided destination.
        let mut output = Tensor::zeros(x.dim(0)?, x.dtype(), x.device())?;
        for (i, cluster) in self.tail.iter().enumerate() {
            let (low, high) = (self.cutoffs[i], self.cutoffs[i + 1]);
            let rows: Vec<u32> = (0..classes.len() as u32)
                .filter(|&r| (low..high).contains(&(classes[r as usize] as usize)))
                .collect();
            if rows.is_empty() {
                continue;
            }
            let relative: Vec<u32> = rows
                .iter()
                .map(|&r| classes[r as usize] as u32 - low as u32)
                .collect();
            let rows = Tensor::new(rows, x.device())?;
            let relative = Tensor::new(relative, x.device())?;
            let local = log_softmax(&cluster.call(&x.contiguous()?.index_select(&rows, 0)?)?, 1)?;
            let picked = local.gather(&relative.unsqueeze(1)?, 1)?.squeeze(1)?;
            output = output.index_add(&rows, &picked, 0)?;
        }
        for &c in &classes {
            let c = c as usize;
            let slot = if c < shortlist {
                c
            } else {
                let cluster = self.cutoffs[1..]
                    .iter()
                    .position(|&end| c < end)
                    .unwrap_or(0);
                shortlist + cluster
            };
            head_ids.push(slot as u32);
        }
        let head = log_softmax(&self.head.call(&x)?, 1)?;
        let head_ids = Tensor::new(head_ids, x.device())?.unsqueeze(1)?;
        let output = (output + head.gather(&head_ids, 1)?.squeeze(1)?)?;
        let loss = output.neg()?.mean_all()?;
        let output = if batched { output } else { output.squeeze(0)? };
        Ok((output, loss))
    }
}

/// The class ids of `t` on the host.
fn host_classes(t: &Tensor) -> Result<Vec<i64>> {
    Ok(t.to_dtype(DType::I64)?.to_vec1::<i64>()?)
}
