//! Multi-head attention.

use candle_core::{DType, Device, Tensor, D};

use crate::attention_masks::{additive_mask, check_masks};
use crate::device::check_input_device;
use crate::error::{Error, Result};
use crate::Init;
use crate::{Forward, Mode, Module, ModuleExt, Param};
use crate::{Linear, LinearConfig};
use module_core::ChildRepr;

/// How a [`MultiheadAttention`] is built: PyTorch's keyword arguments, with PyTorch's defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MultiheadAttentionConfig {
    /// Whether the input and output projections have biases (default `true`).
    pub bias: bool,
    /// Dropout probability on the attention weights, applied in training mode only (default `0.0`).
    pub dropout: f64,
    /// Whether inputs and outputs are `[batch, seq, embed]` (`true`) or `[seq, batch, embed]`
    /// (`false`, PyTorch's default).
    pub batch_first: bool,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for MultiheadAttentionConfig {
    fn default() -> Self {
        Self {
            bias: true,
            dropout: 0.0,
            batch_first: false,
            dtype: DType::F32,
        }
    }
}

/// Scaled dot-product attention over `num_heads` heads: PyTorch's `nn.MultiheadAttention`.
///
/// Parameters, with PyTorch's names, layouts and initialization (`E` = `embed_dim`):
/// `in_proj_weight` `[3E, E]` (the query, key and value projections stacked in that order; Xavier
/// uniform), `in_proj_bias` `[3E]` (zeros), and `out_proj`, a [`Linear`] `E → E` (`out_proj.weight`,
/// `out_proj.bias`, bias zeros). A PyTorch checkpoint loads by name.
///
/// Shapes with `batch_first` (else batch and sequence are swapped; a 2-D input is one unbatched
/// sequence): query `[B, L, E]`, key and value `[B, S, E]`, output `[B, L, E]`, weights `[B, L, S]`
/// averaged over heads (or `[B, num_heads, L, S]`).
///
/// Call it with an [`AttentionInput`] to get `(output, Option<weights>)` and to pass masks, or with a
/// plain tensor for unmasked self-attention returning only the output (so it fits in a
/// [`Sequential`](crate::Sequential)).
///
/// Not supported: `kdim`/`vdim` different from `embed_dim`, `add_bias_kv`, `add_zero_attn`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{AttentionInput, MultiheadAttention, MultiheadAttentionConfig};
///
/// let dev = Device::Cpu;
/// let config = MultiheadAttentionConfig { batch_first: true, ..Default::default() };
/// let mha = MultiheadAttention::with_config(8, 2, config, &dev)?;
/// let x = Tensor::randn(0f32, 1., (2, 5, 8), &dev)?;
/// // 1 = padded: the last two positions of the second sequence are ignored as keys.
/// let mask = Tensor::new(&[[0u8, 0, 0, 0, 0], [0, 0, 0, 1, 1]], &dev)?;
/// let (y, weights) = mha.call(AttentionInput::new(&x, &x, &x).key_padding_mask(&mask))?;
/// assert_eq!(y.dims(), [2, 5, 8]);
/// assert_eq!(weights.unwrap().dims(), [2, 5, 5]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`MultiheadAttentionPath`], from [`MultiheadAttention::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct MultiheadAttention {
    /// `[3 * embed_dim, embed_dim]`: query, key and value projections, stacked.
    pub in_proj_weight: Param,
    /// `[3 * embed_dim]`, if the layer has biases.
    pub in_proj_bias: Option<Param>,
    /// The output projection, `embed_dim → embed_dim`.
    pub out_proj: Linear,
    num_heads: usize,
    dropout: f64,
    batch_first: bool,
    training: Mode,
}

/// The arguments of a [`MultiheadAttention`] call: PyTorch's `forward(query, key, value, …)`.
///
/// Defaults follow PyTorch: no masks, `need_weights = true`, `average_attn_weights = true`.
#[derive(Clone, Copy, Debug)]
pub struct AttentionInput<'a> {
    /// `[B, L, E]` (batch first), `[L, B, E]`, or `[L, E]` unbatched.
    pub query: &'a Tensor,
    /// `[B, S, E]`, laid out like the query.
    pub key: &'a Tensor,
    /// `[B, S, E]`, laid out like the query.
    pub value: &'a Tensor,
    /// `[B, S]` (`[S]` unbatched). An integer mask marks padded keys with a non-zero value (PyTorch's
    /// `True`); a floating-point mask is added to the attention scores.
    pub key_padding_mask: Option<&'a Tensor>,
    /// `[L, S]` or `[B * num_heads, L, S]`. An integer mask marks forbidden pairs with a non-zero
    /// value; a floating-point mask is added to the attention scores (e.g. `-inf` above the diagonal).
    pub attn_mask: Option<&'a Tensor>,
    /// Whether to return the attention weights.
    pub need_weights: bool,
    /// Whether the returned weights are averaged over heads (`[B, L, S]`) or per head
    /// (`[B, num_heads, L, S]`).
    pub average_attn_weights: bool,
}

/// An [`AttentionInput`] that owns its tensors: what a typed forward hook
/// ([`register_typed_hook`](module_hooks::Hooks::register_typed_hook)) on a [`MultiheadAttention`] sees
/// of the call's input (its [`TensorTree::Owned`](crate::TensorTree::Owned) form).
#[derive(Clone, Debug)]
pub struct OwnedAttentionInput {
    /// See [`AttentionInput::query`].
    pub query: Tensor,
    /// See [`AttentionInput::key`].
    pub key: Tensor,
    /// See [`AttentionInput::value`].
    pub value: Tensor,
    /// See [`AttentionInput::key_padding_mask`].
    pub key_padding_mask: Option<Tensor>,
    /// See [`AttentionInput::attn_mask`].
    pub attn_mask: Option<Tensor>,
    /// See [`AttentionInput::need_weights`].
    pub need_weights: bool,
    /// See [`AttentionInput::average_attn_weights`].
    pub average_attn_weights: bool,
}

impl OwnedAttentionInput {
    /// The input borrowing these tensors, to call a [`MultiheadAttention`] with.
    pub fn as_input(&self) -> AttentionInput<'_> {
        AttentionInput {
            query: &self.query,
            key: &self.key,
            value: &self.value,
            key_padding_mask: self.key_padding_mask.as_ref(),
            attn_mask: self.attn_mask.as_ref(),
            need_weights: self.need_weights,
            average_attn_weights: self.average_attn_weights,
        }
    }
}

/// In the order of [`AttentionInput`]'s tensors: `query`, `key`, `value`, then the masks present.
impl crate::TensorStruct for OwnedAttentionInput {
    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        crate::TensorTree::for_each_tensor(&self.as_input(), f)
    }

    fn map_tensors(self, f: &mut dyn FnMut(Tensor) -> Tensor) -> Self {
        Self {
            query: f(self.query),
            key: f(self.key),
            value: f(self.value),
            key_padding_mask: self.key_padding_mask.map(&mut *f),
            attn_mask: self.attn_mask.map(&mut *f),
            ..self
        }
    }

    fn clone_tree(&self) -> Option<Self> {
        Some(self.clone())
    }
}

impl<'a> AttentionInput<'a> {
    /// Attention of `query` over `key`/`value`, with PyTorch's defaults.
    pub fn new(query: &'a Tensor, key: &'a Tensor, value: &'a Tensor) -> Self {
        Self {
            query,
            key,
            value,
            key_padding_mask: None,
            attn_mask: None,
            need_weights: true,
            average_attn_weights: true,
        }
    }

    /// Self-attention: `x` is the query, the key and the value.
    pub fn self_attention(x: &'a Tensor) -> Self {
        Self::new(x, x, x)
    }

    /// Sets the key padding mask (see the field).
    pub fn key_padding_mask(mut self, mask: &'a Tensor) -> Self {
        self.key_padding_mask = Some(mask);
        self
    }

    /// Sets the attention mask (see the field).
    pub fn attn_mask(mut self, mask: &'a Tensor) -> Self {
        self.attn_mask = Some(mask);
        self
    }

    /// Whether to return the attention weights.
    pub fn need_weights(mut self, need: bool) -> Self {
        self.need_weights = need;
        self
    }

    /// Whether to average the returned weights over heads.
    pub fn average_attn_weights(mut self, average: bool) -> Self {
        self.average_attn_weights = average;
        self
    }
}

/// PyTorch's text: no settings of its own, and `out_proj` shown with PyTorch's class name,
/// `(out_proj): NonDynamicallyQuantizableLinear(in_features=16, out_features=16, bias=True)`.
impl module_core::ExtraRepr for MultiheadAttention {
    fn extra_repr(&self) -> String {
        String::new()
    }

    fn child_repr(&self, child: &str) -> ChildRepr {
        match child {
            "out_proj" => ChildRepr::Class("NonDynamicallyQuantizableLinear"),
            _ => ChildRepr::Own,
        }
    }
}

impl MultiheadAttention {
    /// A float32 layer with PyTorch's defaults (biases, no dropout, `[seq, batch, embed]` inputs).
    pub fn new(embed_dim: usize, num_heads: usize, device: &Device) -> Result<Self> {
        Self::with_config(embed_dim, num_heads, Default::default(), device)
    }

    /// A layer built as `config` says, initialized like PyTorch. `embed_dim` must be divisible
    /// by `num_heads` ([`Error::InvalidConfig`] otherwise).
    pub fn with_config(
        embed_dim: usize,
        num_heads: usize,
        config: MultiheadAttentionConfig,
        device: &Device,
    ) -> Result<Self> {
        if num_heads == 0 || !embed_dim.is_multiple_of(num_heads) {
            return Err(Error::InvalidConfig {
                layer: "MultiheadAttention",
                message: format!(
                    "embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
                ),
            });
        }
        let dtype = config.dtype;
        // Xavier uniform over [3E, E]: fan_in = E, fan_out = 3E.
        let bound = (6.0 / (4 * embed_dim).max(1) as f64).sqrt();
        let xavier = Init::Uniform {
            low: -bound,
            high: bound,
        };
        let in_proj_weight = Param::init((3 * embed_dim, embed_dim), xavier, 0, dtype, device)?;
        let zeros = |n: usize| Param::init(n, Init::Zeros, 0, dtype, device);
        let no_bias = LinearConfig { bias: false, dtype };
        let mut out_proj = Linear::with_config(embed_dim, embed_dim, no_bias, device)?;
        let in_proj_bias = if config.bias {
            out_proj.bias = Some(zeros(embed_dim)?);
            Some(zeros(3 * embed_dim)?)
        } else {
            None
        };
        Ok(Self {
            in_proj_weight,
            in_proj_bias,
            out_proj,
            num_heads,
            dropout: config.dropout,
            batch_first: config.batch_first,
            training: Mode::new(),
        })
    }

    /// The model width `E`.
    pub fn embed_dim(&self) -> usize {
        self.in_proj_weight.shape().dims()[1]
    }

    /// The number of heads.
    pub fn num_heads(&self) -> usize {
        self.num_heads
    }

    /// Whether inputs are `[batch, seq, embed]`.
    pub fn batch_first(&self) -> bool {
        self.batch_first
    }

    /// Projects `x` `[B, T, E]` with rows `chunk * E .. (chunk + n) * E` of the input projection.
    fn in_proj(&self, x: &Tensor, chunk: usize, n: usize) -> Result<Tensor> {
        let e = self.embed_dim();
        let w = self.in_proj_weight.tensor()?.narrow(0, chunk * e, n * e)?;
        let (b, t, _) = x.dims3()?;
        let bias = match &self.in_proj_bias {
            Some(bias) => Some(bias.tensor()?.narrow(0, chunk * e, n * e)?),
            None => None,
        };
        // The kernels' `linear`: under autocast a lower-precision op, as PyTorch's `in_proj`.
        let y = module_kernels::linear(&x.reshape((b * t, e))?, &w, bias.as_ref())?;
        Ok(y.reshape((b, t, n * e))?)
    }

    /// `[B, T, E]` → `[B, heads, T, E / heads]`.
    fn split_heads(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, e) = x.dims3()?;
        let x = x.reshape((b, t, self.num_heads, e / self.num_heads))?;
        Ok(x.transpose(1, 2)?.contiguous()?)
    }

    /// Query, key and value: `[B, L, E]`/`[L, B, E]` (or `[L, E]` unbatched), all of one rank,
    /// the last dimension `embed_dim`; a mismatch names the tensor, both sizes and the fix.
    fn check_inputs(&self, input: &AttentionInput<'_>) -> Result<()> {
        let e = self.embed_dim();
        let rank = input.query.rank();
        for (name, t) in [
            ("query", input.query),
            ("key", input.key),
            ("value", input.value),
        ] {
            let fail = |what: String| Error::InvalidInput {
                layer: "MultiheadAttention",
                message: format!("{name} {:?}: {what}", t.dims()),
            };
            if !(2..=3).contains(&t.rank()) || t.rank() != rank {
                return Err(fail(format!(
                    "expected {} ([L, E] unbatched, or 3-D) like the query",
                    if self.batch_first {
                        "[B, L, E]"
                    } else {
                        "[L, B, E]"
                    }
                )));
            }
            let got = t.dims()[t.rank() - 1];
            if got != e {
                return Err(fail(format!(
                    "expected embed_dim = {e}, got {got} (last dimension): give it inputs of \
                     width {e}, or make the layer `MultiheadAttention::new({got}, {}, ..)`",
                    self.num_heads
                )));
            }
        }
        Ok(())
    }

    fn attend(&self, input: AttentionInput<'_>) -> Result<(Tensor, Option<Tensor>)> {
        let w = self.in_proj_weight.tensor()?;
        let masks = [input.key_padding_mask, input.attn_mask];
        for t in [input.query, input.key, input.value]
            .into_iter()
            .chain(masks.into_iter().flatten())
        {
            check_input_device("MultiheadAttention.in_proj_weight", &w, t)?;
        }
        self.check_inputs(&input)?;
        let unbatched = input.query.rank() == 2;
        let layout = |t: &Tensor| -> Result<Tensor> {
            Ok(match (unbatched, self.batch_first) {
                (true, _) => t.unsqueeze(0)?,
                (false, true) => t.clone(),
                (false, false) => t.transpose(0, 1)?,
            })
        };
        let (q, k, v) = (
            layout(input.query)?,
            layout(input.key)?,
            layout(input.value)?,
        );
        let e = self.embed_dim();
        let (b, l, _) = q.dims3()?;
        let s = k.dim(1)?;
        check_masks(&input, unbatched, b, l, s, self.num_heads)?;

        // Self-attention projects once with the stacked weight; otherwise one projection each.
        let same = |a: &Tensor, b: &Tensor| a.id() == b.id();
        let (q, k, v) = if same(input.query, input.key) && same(input.key, input.value) {
            let qkv = self.in_proj(&q, 0, 3)?;
            (
                qkv.narrow(2, 0, e)?,
                qkv.narrow(2, e, e)?,
                qkv.narrow(2, 2 * e, e)?,
            )
        } else {
            (
                self.in_proj(&q, 0, 1)?,
                self.in_proj(&k, 1, 1)?,
                self.in_proj(&v, 2, 1)?,
            )
        };
        let head_dim = e / self.num_heads;
        let q = (self.split_heads(&q)? * (1.0 / (head_dim as f64).sqrt()))?;
        let (k, v) = (self.split_heads(&k)?, self.split_heads(&v)?);
        let mut scores = q.matmul(&k.t()?)?; // [B, H, L, S]

        if let Some(mask) = input.key_padding_mask {
            let mask = if unbatched {
                mask.unsqueeze(0)?
            } else {
                mask.clone()
            };
            let additive = additive_mask(&mask.reshape((b, 1, 1, s))?, scores.dtype())?;
            scores = scores.broadcast_add(&additive)?;
        }
        if let Some(mask) = input.attn_mask {
            let mask = match mask.rank() {
                2 => mask.reshape((1, 1, l, s))?,
                _ => mask.reshape((b, self.num_heads, l, s))?,
            };
            scores = scores.broadcast_add(&additive_mask(&mask, scores.dtype())?)?;
        }
        let mut weights = softmax_last_dim(&scores)?;
        if self.dropout > 0.0 && self.training.is_training() {
            weights = crate::dropout::dropout_in_training(&weights, self.dropout)?;
        }

        let out = weights.matmul(&v)?.transpose(1, 2)?.reshape((b, l, e))?;
        let out = self.out_proj.call(&out)?;
        let out = match (unbatched, self.batch_first) {
            (true, _) => out.squeeze(0)?,
            (false, true) => out,
            (false, false) => out.transpose(0, 1)?,
        };
        let weights = match input.need_weights {
            false => None,
            true => {
                let w = match input.average_attn_weights {
                    true => weights.mean(1)?,
                    false => weights,
                };
                Some(if unbatched { w.squeeze(0)? } else { w })
            }
        };
        Ok((out, weights))
    }
}

/// Softmax over the last dimension, built from differentiable ops (candle-nn's fused
/// `softmax_last_dim` records no gradient). The row maximum is only a shift for numerical range, so
/// it is detached: the result does not depend on it.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    // Half precision (scores under autocast): computed in float32, rounded once, as PyTorch's
    // CPU softmax accumulates.
    if matches!(
        x.dtype(),
        candle_core::DType::BF16 | candle_core::DType::F16
    ) {
        return Ok(softmax_last_dim(&x.to_dtype(candle_core::DType::F32)?)?.to_dtype(x.dtype())?);
    }
    let max = x.max_keepdim(D::Minus1)?.detach();
    let exp = x.broadcast_sub(&max)?.exp()?;
    Ok(exp.broadcast_div(&exp.sum_keepdim(D::Minus1)?)?)
}

impl Forward<AttentionInput<'_>> for MultiheadAttention {
    type Output = (Tensor, Option<Tensor>);

    fn forward(&self, input: AttentionInput<'_>) -> Result<(Tensor, Option<Tensor>)> {
        self.attend(input)
    }
}

impl Forward<&Tensor> for MultiheadAttention {
    type Output = Tensor;

    /// Unmasked self-attention, output only.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let input = AttentionInput::self_attention(x).need_weights(false);
        Ok(self.attend(input)?.0)
    }
}

impl Forward<Tensor> for MultiheadAttention {
    type Output = Tensor;

    fn forward(&self, x: Tensor) -> Result<Tensor> {
        self.forward(&x)
    }
}

impl candle_core::Module for MultiheadAttention {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        Ok(Forward::forward(self, x)?)
    }
}

impl crate::tensor_tree::sealed::Sealed for AttentionInput<'_> {}

/// Hooks see `query`, `key`, `value`, then the masks that are present.
impl crate::TensorTree for AttentionInput<'_> {
    type Owned = OwnedAttentionInput;

    fn to_owned_tree(&self) -> Option<OwnedAttentionInput> {
        Some(OwnedAttentionInput {
            query: self.query.clone(),
            key: self.key.clone(),
            value: self.value.clone(),
            key_padding_mask: self.key_padding_mask.cloned(),
            attn_mask: self.attn_mask.cloned(),
            need_weights: self.need_weights,
            average_attn_weights: self.average_attn_weights,
        })
    }

    fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
        self.query.for_each_tensor(f);
        self.key.for_each_tensor(f);
        self.value.for_each_tensor(f);
        self.key_padding_mask.for_each_tensor(f);
        self.attn_mask.for_each_tensor(f);
    }

    fn rebuild(
        self,
        next: &mut dyn FnMut(&Tensor) -> Tensor,
        scope: &crate::tensor_tree::Scope,
    ) -> Self {
        Self {
            query: self.query.rebuild(next, scope),
            key: self.key.rebuild(next, scope),
            value: self.value.rebuild(next, scope),
            key_padding_mask: self.key_padding_mask.rebuild(next, scope),
            attn_mask: self.attn_mask.rebuild(next, scope),
            ..self
        }
    }
}
