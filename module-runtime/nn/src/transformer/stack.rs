//! `nn.TransformerEncoder` and `nn.TransformerDecoder`: one [`TransformerStack`] of layers with an
//! optional final norm, over encoder or decoder layers.

use super::{TransformerDecoderLayer, TransformerEncoderLayer};
use crate::error::Result;
use crate::module::ChildMut;
use crate::{LayerNorm, Module, ModuleList};

/// `num_layers` copies of a Transformer layer run in order, then an optional final norm: what
/// PyTorch's `nn.TransformerEncoder` and `nn.TransformerDecoder` share. Use it through those two
/// names ([`TransformerEncoder`], [`TransformerDecoder`]); summaries and errors show them.
///
/// The layers are copies of the given one with parameters of their own (they start equal, as
/// PyTorch's deep copies do), under PyTorch's keys `layers.0.…`, `layers.1.…`, and `norm.…`.
///
/// Typed paths into it: [`TransformerStackPath`], from [`TransformerStack::path`].
#[derive(Module, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(class_name = stack_class_name::<L>())]
pub struct TransformerStack<L: Module> {
    /// The layers, in order.
    pub layers: ModuleList<L>,
    /// The final norm, if any.
    pub norm: Option<LayerNorm>,
}

/// The class name of a stack of `L`s: PyTorch's `TransformerEncoder` and `TransformerDecoder` for
/// the two layers PyTorch stacks, `TransformerStack<L>` (with `L`'s class name) for any other.
fn stack_class_name<L: Module>() -> String {
    use std::any::{type_name, TypeId};
    let layer = TypeId::of::<L>();
    if layer == TypeId::of::<TransformerEncoderLayer>() {
        "TransformerEncoder".to_owned()
    } else if layer == TypeId::of::<TransformerDecoderLayer>() {
        "TransformerDecoder".to_owned()
    } else {
        let stack = type_name::<TransformerStack<L>>();
        module_core::generic_class_name(stack, &[(type_name::<L>(), L::type_class_name())])
    }
}

impl<L: Module + Clone> TransformerStack<L> {
    /// `num_layers` copies of `layer`, then `norm` if given.
    pub fn new(layer: &L, num_layers: usize, norm: Option<LayerNorm>) -> Result<Self> {
        let layers = (0..num_layers)
            .map(|_| {
                let mut copy = layer.clone();
                let mut failed = Ok(());
                fresh_params(&mut copy, &mut failed);
                failed.map(|()| copy)
            })
            .collect::<Result<Vec<L>>>()?;
        Ok(Self {
            layers: layers.into(),
            norm,
        })
    }

    /// The final norm of `x`, if the stack has one.
    pub(super) fn final_norm(&self, x: candle_core::Tensor) -> Result<candle_core::Tensor> {
        match &self.norm {
            Some(norm) => crate::ModuleExt::call(norm, &x),
            None => Ok(x),
        }
    }
}

/// Gives every parameter under `module` a copy of its own.
fn fresh_params(module: &mut dyn Module, failed: &mut Result<()>) {
    module.visit_children_mut(&mut |_, child| match child {
        ChildMut::Module(m) => fresh_params(m, failed),
        ChildMut::Param(p) => match p.deep_copy() {
            Ok(fresh) => *p = fresh,
            Err(e) => *failed = Err(e),
        },
        _ => {}
    });
}

/// A stack of `num_layers` [`TransformerEncoderLayer`]s, with an optional final norm: PyTorch's
/// `nn.TransformerEncoder(encoder_layer, num_layers, norm=None)`.
///
/// The layers are copies of the given one with parameters of their own (they start equal, as
/// PyTorch's deep copies do), under PyTorch's keys `layers.0.…`, `layers.1.…`, and `norm.…`. Every
/// layer gets the call's masks.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{
///     EncoderInput, LayerNorm, TransformerEncoder, TransformerEncoderLayer, TransformerLayerConfig,
/// };
///
/// let dev = Device::Cpu;
/// let config = TransformerLayerConfig { dim_feedforward: 32, norm_first: true, ..Default::default() };
/// let layer = TransformerEncoderLayer::with_config(16, 4, config, &dev)?;
/// let encoder = TransformerEncoder::new(&layer, 2, Some(LayerNorm::new(16, &dev)?))?;
/// assert!(encoder.state_dict()?.contains_key("layers.1.self_attn.in_proj_weight"));
/// let x = Tensor::randn(0f32, 1., (5, 2, 16), &dev)?; // [seq, batch, feature]
/// let y = encoder.call(EncoderInput::new(&x).is_causal(true))?;
/// assert_eq!(y.dims(), [5, 2, 16]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`TransformerStackPath`], from [`TransformerStack::path`].
pub type TransformerEncoder = TransformerStack<TransformerEncoderLayer>;

/// A stack of `num_layers` [`TransformerDecoderLayer`]s, with an optional final norm: PyTorch's
/// `nn.TransformerDecoder(decoder_layer, num_layers, norm=None)`.
///
/// The layers are copies of the given one with parameters of their own (they start equal, as
/// PyTorch's deep copies do), under PyTorch's keys `layers.0.…` and `norm.…`. Every layer attends to
/// the same `memory` with the call's masks.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{
///     DecoderInput, TransformerDecoder, TransformerDecoderLayer, TransformerLayerConfig,
/// };
///
/// let dev = Device::Cpu;
/// let config = TransformerLayerConfig { dim_feedforward: 32, batch_first: true, ..Default::default() };
/// let layer = TransformerDecoderLayer::with_config(16, 4, config, &dev)?;
/// let decoder = TransformerDecoder::new(&layer, 2, None)?;
/// let tgt = Tensor::randn(0f32, 1., (2, 4, 16), &dev)?;
/// let memory = Tensor::randn(0f32, 1., (2, 6, 16), &dev)?;
/// assert_eq!(decoder.call(DecoderInput::new(&tgt, &memory))?.dims(), [2, 4, 16]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`TransformerStackPath`], from [`TransformerStack::path`].
pub type TransformerDecoder = TransformerStack<TransformerDecoderLayer>;
