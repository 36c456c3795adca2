//! PyTorch's Transformer blocks: `nn.TransformerEncoderLayer`, `nn.TransformerEncoder`,
//! `nn.TransformerDecoderLayer`, `nn.TransformerDecoder` and `nn.Transformer`, with PyTorch's
//! arguments, defaults, masks and state-dict keys (`layers.0.self_attn.in_proj_weight`,
//! `layers.0.linear1.weight`, `layers.0.norm1.weight`, …), built on [`MultiheadAttention`],
//! [`Linear`], [`LayerNorm`] and [`Dropout`].
//!
//! Shared here: the layers' configuration ([`TransformerLayerConfig`]), their feed-forward block
//! and its activation ([`TransformerActivation`]), the causal mask
//! ([`generate_square_subsequent_mask`]), and the macros that give the calls' inputs
//! ([`EncoderInput`], [`DecoderInput`], [`TransformerInput`]) their builder methods and hook
//! traversal. The stacks are in `stack.rs`.

use candle_core::{DType, Device, Tensor};

use crate::error::{Error, Result};
use crate::typed_path::{HasPath, Path, PathKind};
use crate::Module;
use crate::{AttentionInput, ModuleExt, MultiheadAttention, MultiheadAttentionConfig, ReLU, GELU};
use crate::{Dropout, Forward, Functional, LayerNorm, LayerNormConfig, Linear, LinearConfig};

/// `TensorStruct` for a call's input: its tensors, then its masks that are present, in the order
/// listed (the order hooks see them in).
macro_rules! input_tensors {
    ($ty:ident { $($tensor:ident),* } masks { $($mask:ident),* }) => {
        impl $crate::TensorStruct for $ty {
            fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
                $(f(&self.$tensor);)*
                $(if let Some(mask) = &self.$mask { f(mask) })*
            }

            fn map_tensors(self, f: &mut dyn FnMut(Tensor) -> Tensor) -> Self {
                Self {
                    $($tensor: f(self.$tensor),)*
                    $($mask: self.$mask.map(&mut *f),)*
                    ..self
                }
            }

            fn clone_tree(&self) -> Option<Self> {
                Some(self.clone())
            }
        }
    };
}

/// The builder methods of a call's input: one per mask (`Some(mask.clone())`) and one per flag.
macro_rules! input_setters {
    (masks { $($mask:ident),* } flags { $($flag:ident),* }) => {
        $(
            #[doc = concat!("Sets [`", stringify!($mask), "`](Self::", stringify!($mask), ").")]
            pub fn $mask(mut self, mask: &Tensor) -> Self {
                self.$mask = Some(mask.clone());
                self
            }
        )*
        $(
            #[doc = concat!("Sets [`", stringify!($flag), "`](Self::", stringify!($flag), ").")]
            pub fn $flag(mut self, value: bool) -> Self {
                self.$flag = value;
                self
            }
        )*
    };
}

/// `Forward<&Tensor>` and `Forward<Tensor>` for a module that takes an `$input` made from the
/// tensor alone (no masks).
macro_rules! forward_unmasked {
    ($ty:ident, $input:ident) => {
        impl Forward<&Tensor> for $ty {
            type Output = Tensor;

            /// The call with no masks.
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                self.forward($input::new(x))
            }
        }

        impl Forward<Tensor> for $ty {
            type Output = Tensor;

            fn forward(&self, x: Tensor) -> Result<Tensor> {
                self.forward($input::new(&x))
            }
        }
    };
}

mod decoder;
mod encoder;
mod model;
mod stack;

pub use decoder::{DecoderInput, TransformerDecoderLayer, TransformerDecoderLayerPath};
pub use encoder::{EncoderInput, TransformerEncoderLayer, TransformerEncoderLayerPath};
pub use model::{Transformer, TransformerConfig, TransformerInput, TransformerPath};
pub use stack::{TransformerDecoder, TransformerEncoder, TransformerStack, TransformerStackPath};

/// The activation of a Transformer layer's feed-forward block: PyTorch's `activation` argument,
/// `"relu"` (the default), `"gelu"` (exact), or any callable.
///
/// ```
/// use module_runtime::nn::TransformerActivation;
/// let silu = TransformerActivation::custom(|x: &candle_core::Tensor| x.silu());
/// # let _ = silu;
/// ```
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
pub enum TransformerActivation {
    /// `F.relu`, PyTorch's default.
    Relu(ReLU),
    /// `F.gelu` (the exact, erf form).
    Gelu(GELU),
    /// Any function of a tensor (PyTorch's callable `activation`), e.g. a closure.
    Custom(Functional),
}

impl TransformerActivation {
    /// `"relu"`.
    pub fn relu() -> Self {
        Self::Relu(ReLU::new())
    }

    /// `"gelu"`.
    pub fn gelu() -> Self {
        Self::Gelu(GELU::new())
    }

    /// A function of a tensor, e.g. `|x: &Tensor| x.silu()`.
    pub fn custom<F, E>(f: F) -> Self
    where
        F: Fn(&Tensor) -> std::result::Result<Tensor, E> + Send + Sync + 'static,
        E: Into<Error>,
    {
        Self::Custom(Functional::new(f))
    }
}

/// `print(model)` of the Transformer layers `$ty`: no settings of their own, and no
/// `activation` line, as PyTorch prints a layer built with `activation="relu"`, `"gelu"` or a
/// function (a layer given an `nn.Module` instance as activation prints it in PyTorch; this
/// one prints the same text for all three forms).
macro_rules! repr_without_activation {
    ($($ty:ty),+) => {$(
        impl module_core::ExtraRepr for $ty {
            fn extra_repr(&self) -> String {
                String::new()
            }

            fn child_repr(&self, child: &str) -> module_core::ChildRepr {
                match child {
                    "activation" => module_core::ChildRepr::Hidden,
                    _ => module_core::ChildRepr::Own,
                }
            }
        }
    )+};
}

repr_without_activation!(TransformerEncoderLayer, TransformerDecoderLayer);

/// A path to the activation ends there: it holds no parameters.
impl HasPath for TransformerActivation {
    type Path<R: 'static, K: PathKind> = Path<R, K, Self>;
}

impl Default for TransformerActivation {
    fn default() -> Self {
        Self::relu()
    }
}

impl Forward<&Tensor> for TransformerActivation {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Relu(f) => f.call(x),
            Self::Gelu(f) => f.call(x),
            Self::Custom(f) => f.call(x),
        }
    }
}

/// How a Transformer encoder or decoder layer is built: PyTorch's keyword arguments after
/// `d_model` and `nhead`, with PyTorch's defaults.
#[derive(Clone, Debug)]
pub struct TransformerLayerConfig {
    /// Width of the feed-forward block (default `2048`).
    pub dim_feedforward: usize,
    /// Dropout probability after attention, inside and after the feed-forward block, and on the
    /// attention weights; training mode only (default `0.1`).
    pub dropout: f64,
    /// The feed-forward activation (default ReLU).
    pub activation: TransformerActivation,
    /// The layer norms' epsilon (default `1e-5`).
    pub layer_norm_eps: f64,
    /// Whether inputs are `[batch, seq, feature]` (`true`) or `[seq, batch, feature]` (`false`,
    /// PyTorch's default).
    pub batch_first: bool,
    /// Whether each block normalizes its input (pre-norm, `true`) or the residual sum (post-norm,
    /// `false`, PyTorch's default).
    pub norm_first: bool,
    /// Whether the linear layers, the attention projections and the layer norms have biases
    /// (default `true`).
    pub bias: bool,
    /// The parameters' floating-point dtype (default `F32`).
    pub dtype: DType,
}

impl Default for TransformerLayerConfig {
    fn default() -> Self {
        Self {
            dim_feedforward: 2048,
            dropout: 0.1,
            activation: TransformerActivation::relu(),
            layer_norm_eps: 1e-5,
            batch_first: false,
            norm_first: false,
            bias: true,
            dtype: DType::F32,
        }
    }
}

impl TransformerLayerConfig {
    /// Refuses what PyTorch refuses: a dropout probability outside `[0, 1]`.
    fn check(&self, layer: &'static str) -> Result<()> {
        if !(0.0..=1.0).contains(&self.dropout) {
            return Err(Error::InvalidConfig {
                layer,
                message: format!(
                    "dropout probability has to be between 0 and 1, but got {}",
                    self.dropout
                ),
            });
        }
        Ok(())
    }

    fn attention(
        &self,
        d_model: usize,
        nhead: usize,
        device: &Device,
    ) -> Result<MultiheadAttention> {
        let config = MultiheadAttentionConfig {
            bias: self.bias,
            dropout: self.dropout,
            batch_first: self.batch_first,
            dtype: self.dtype,
        };
        MultiheadAttention::with_config(d_model, nhead, config, device)
    }

    /// The feed-forward block's `linear1`, `dropout` and `linear2`.
    fn feed_forward(&self, d_model: usize, device: &Device) -> Result<(Linear, Dropout, Linear)> {
        let config = LinearConfig {
            bias: self.bias,
            dtype: self.dtype,
        };
        let width = self.dim_feedforward;
        Ok((
            Linear::with_config(d_model, width, config, device)?,
            Dropout::new(self.dropout),
            Linear::with_config(width, d_model, config, device)?,
        ))
    }

    fn norm(&self, d_model: usize, device: &Device) -> Result<LayerNorm> {
        layer_norm(d_model, self.layer_norm_eps, self.bias, self.dtype, device)
    }
}

/// `nn.LayerNorm(d_model, eps, bias=bias)`.
fn layer_norm(d: usize, eps: f64, bias: bool, dtype: DType, device: &Device) -> Result<LayerNorm> {
    let config = LayerNormConfig {
        eps,
        bias,
        dtype,
        ..Default::default()
    };
    LayerNorm::with_config(d, config, device)
}

/// The feed-forward block both layers share: `dropout_after(linear2(dropout(activation(linear1(x)))))`,
/// the first linear layer and a ReLU or GELU in one pass where the fused inference pass applies
/// ([`Linear::call_then`]).
fn feed_forward(
    [linear1, linear2]: [&Linear; 2],
    activation: &TransformerActivation,
    [dropout, dropout_after]: [&Dropout; 2],
    x: &Tensor,
) -> Result<Tensor> {
    let h = match activation {
        TransformerActivation::Relu(f) => linear1.call_then(x, f)?,
        TransformerActivation::Gelu(f) => linear1.call_then(x, f)?,
        TransformerActivation::Custom(f) => f.call(&linear1.call(x)?)?,
    };
    dropout_after.call(&linear2.call(&dropout.call(&h)?)?)
}

/// An attention block of either layer: `dropout(attention(query, key, key))` with an attention
/// mask and a key padding mask, the weights not computed (`key` is `query` for self-attention,
/// which projects once).
fn attention_block(
    attention: &MultiheadAttention,
    dropout: &Dropout,
    query: &Tensor,
    key: &Tensor,
    (mask, padding): (Option<&Tensor>, Option<&Tensor>),
) -> Result<Tensor> {
    let mut input = AttentionInput::new(query, key, key).need_weights(false);
    input.attn_mask = mask;
    input.key_padding_mask = padding;
    dropout.call(&attention.call(input)?.0)
}

/// A float mask of shape `[sz, sz]` with `-inf` above the diagonal and `0` on and below it:
/// PyTorch's `nn.Transformer.generate_square_subsequent_mask`, the `src_mask`/`tgt_mask` that lets
/// position `i` attend to positions `<= i` only.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::generate_square_subsequent_mask;
/// let mask = generate_square_subsequent_mask(3, DType::F32, &Device::Cpu)?;
/// let inf = f32::NEG_INFINITY;
/// assert_eq!(mask.to_vec2::<f32>()?, [[0., inf, inf], [0., 0., inf], [0., 0., 0.]]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn generate_square_subsequent_mask(sz: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let blocked = causal_mask(sz, sz, device)?;
    let neg_inf = Tensor::full(f32::NEG_INFINITY, (sz, sz), device)?.to_dtype(dtype)?;
    let zero = Tensor::zeros((sz, sz), dtype, device)?;
    Ok(blocked.where_cond(&neg_inf, &zero)?)
}

/// A `u8` mask `[l, s]`, 1 (blocked) where the key position is after the query position.
fn causal_mask(l: usize, s: usize, device: &Device) -> Result<Tensor> {
    let rows = Tensor::arange(0u32, l as u32, device)?.reshape((l, 1))?;
    let cols = Tensor::arange(0u32, s as u32, device)?.reshape((1, s))?;
    Ok(cols.broadcast_gt(&rows)?)
}

/// The attention mask a call uses: `mask` if given; with `is_causal` and no mask, the causal mask
/// for `l` queries and `s` keys (PyTorch treats `is_causal` as a hint that the mask it is given is
/// causal and raises without one; here the mask is made).
fn resolve_mask(
    mask: Option<&Tensor>,
    is_causal: bool,
    l: usize,
    s: usize,
    device: &Device,
) -> Result<Option<Tensor>> {
    Ok(match (mask, is_causal) {
        (Some(mask), _) => Some(mask.clone()),
        (None, true) => Some(causal_mask(l, s, device)?),
        (None, false) => None,
    })
}

/// The sequence length of an input laid out as the layers say (`[B, T, E]`, `[T, B, E]`, `[T, E]`).
fn seq_len(x: &Tensor, batch_first: bool) -> Result<usize> {
    let dim = if x.rank() == 3 && batch_first { 1 } else { 0 };
    Ok(x.dim(dim)?)
}

/// PyTorch's `nn.Transformer._reset_parameters`: Xavier-uniform for every parameter of rank > 1.
fn xavier_reset(module: &dyn Module) -> Result<()> {
    for (_, p) in module.named_parameters() {
        if let [fan_out, fan_in] = *p.shape().dims() {
            let bound = (6.0 / (fan_in + fan_out) as f64).sqrt();
            let value =
                module_core::rand(-bound, bound, (fan_out, fan_in), p.dtype(), &Device::Cpu)?;
            p.set(&value.to_device(&p.device())?)?;
        }
    }
    Ok(())
}

/// `x + y` for a residual connection, the two promoted to one dtype first as PyTorch's `+`
/// promotes them (a bfloat16 block output under [`autocast`](module_core::autocast) added to a
/// float32 stream is float32).
pub(crate) fn residual_sum(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let [x, y] = module_core::autocast_policy::promote([x, y])?;
    Ok((x + y)?)
}
