//! The weights of recurrent layers under PyTorch's names: one layer's (`weight_ih`, `weight_hh`,
//! `bias_ih`, `bias_hh`) and a stack's (`weight_ih_l0`, …).

use candle_core::{DType, Device, Tensor};

use super::config::RnnConfig;
use crate::common::uniform_fan_in;
use crate::error::Result;
use crate::module::{Child, ChildMut, Name};
use crate::{Module, Param};

/// One layer's weights, `gates` blocks of `hidden_size` rows each, under PyTorch's cell names
/// (`weight_ih`, `weight_hh`, `bias_ih`, `bias_hh`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub(super) struct LayerWeights {
    pub(super) weight_ih: Param,
    weight_hh: Param,
    bias_ih: Option<Param>,
    bias_hh: Option<Param>,
}

impl LayerWeights {
    /// PyTorch's init: every weight and bias uniform on `±1/sqrt(hidden_size)`.
    pub(super) fn new(
        gates: usize,
        input_size: usize,
        hidden_size: usize,
        bias: bool,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let uniform = |dims: &[usize]| uniform_fan_in(dims, hidden_size, dtype, device);
        let rows = gates * hidden_size;
        let bias = || -> Result<Option<Param>> { bias.then(|| uniform(&[rows])).transpose() };
        Ok(Self {
            weight_ih: uniform(&[rows, input_size])?,
            weight_hh: uniform(&[rows, hidden_size])?,
            bias_ih: bias()?,
            bias_hh: bias()?,
        })
    }

    /// The input size, from `weight_ih` `[G·H, in]`.
    /// Whether the layer has the biases `bias_ih` and `bias_hh`.
    pub(super) fn has_bias(&self) -> bool {
        self.bias_ih.is_some()
    }

    pub(super) fn input_size(&self) -> usize {
        self.weight_ih.shape().dims().get(1).copied().unwrap_or(0)
    }

    /// `x W_ih^T + b_ih`: `[N, in]` → `[N, G·H]`.
    pub(super) fn project_input(&self, x: &Tensor) -> Result<Tensor> {
        let y = module_kernels::product_operand(x)?.matmul(&self.weight_ih.tensor()?.t()?)?;
        Ok(match &self.bias_ih {
            Some(bias) => y.broadcast_add(&bias.tensor()?)?,
            None => y,
        })
    }

    /// `x W_ih^T + b_ih` for every time step at once: `[B, T, in]` → `[B, T, G·H]`.
    pub(super) fn project_sequence(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, i) = x.dims3()?;
        let y = self.project_input(&x.reshape((b * t, i))?)?;
        let rows = y.dim(1)?;
        Ok(y.reshape((b, t, rows))?)
    }

    /// `h W_hh^T + b_hh`: `[B, H]` → `[B, G·H]`.
    pub(super) fn project_hidden(&self, h: &Tensor) -> Result<Tensor> {
        let y = module_kernels::product_operand(h)?.matmul(&self.weight_hh.tensor()?.t()?)?;
        Ok(match &self.bias_hh {
            Some(bias) => y.broadcast_add(&bias.tensor()?)?,
            None => y,
        })
    }
}

/// The weights of a stack of recurrent layers, listed under PyTorch's flat names
/// (`weight_ih_l0`, `weight_hh_l0`, `bias_ih_l0`, `bias_hh_l0`, `weight_ih_l1`, …), which a derived
/// struct cannot spell, hence the hand-written `Module` impl.
#[derive(Clone, Debug)]
pub(super) struct StackedWeights {
    pub(super) layers: Vec<LayerWeights>,
    names: Vec<[String; 4]>,
}

/// A node with no typed path methods: its names are built at run time.
impl crate::typed_path::HasPath for StackedWeights {
    type Path<R: 'static, K: crate::typed_path::PathKind> = crate::typed_path::Path<R, K, Self>;
}

impl StackedWeights {
    /// PyTorch's init: every weight and bias uniform on `±1/sqrt(hidden_size)`.
    pub(super) fn new(
        gates: usize,
        input_size: usize,
        hidden_size: usize,
        config: &RnnConfig,
        device: &Device,
    ) -> Result<Self> {
        let mut layers = Vec::with_capacity(config.num_layers);
        let mut names = Vec::with_capacity(config.num_layers);
        for k in 0..config.num_layers {
            let layer_input = if k == 0 { input_size } else { hidden_size };
            layers.push(LayerWeights::new(
                gates,
                layer_input,
                hidden_size,
                config.bias,
                config.dtype,
                device,
            )?);
            names.push(
                ["weight_ih", "weight_hh", "bias_ih", "bias_hh"].map(|n| format!("{n}_l{k}")),
            );
        }
        Ok(Self { layers, names })
    }
}

#[diagnostic::do_not_recommend]
impl Module for StackedWeights {
    fn visit_children<'a>(&'a self, f: &mut dyn FnMut(Name<'_>, Child<'a>)) {
        for (layer, [w_ih, w_hh, b_ih, b_hh]) in self.layers.iter().zip(&self.names) {
            f(Name::Field(w_ih), Child::Param(&layer.weight_ih));
            f(Name::Field(w_hh), Child::Param(&layer.weight_hh));
            if let Some(b) = &layer.bias_ih {
                f(Name::Field(b_ih), Child::Param(b));
            }
            if let Some(b) = &layer.bias_hh {
                f(Name::Field(b_hh), Child::Param(b));
            }
        }
    }

    fn visit_children_mut<'a>(&'a mut self, f: &mut dyn FnMut(Name<'_>, ChildMut<'a>)) {
        for (layer, [w_ih, w_hh, b_ih, b_hh]) in self.layers.iter_mut().zip(&self.names) {
            f(Name::Field(w_ih), ChildMut::Param(&mut layer.weight_ih));
            f(Name::Field(w_hh), ChildMut::Param(&mut layer.weight_hh));
            if let Some(b) = &mut layer.bias_ih {
                f(Name::Field(b_ih), ChildMut::Param(b));
            }
            if let Some(b) = &mut layer.bias_hh {
                f(Name::Field(b_hh), ChildMut::Param(b));
            }
        }
    }
}
