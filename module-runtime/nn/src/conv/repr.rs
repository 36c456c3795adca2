//! `print(model)` of the convolutions: PyTorch's `_ConvNd.extra_repr` ([`ConvRepr`]), shared by
//! [`Conv`] and the transposed convolutions.

use std::fmt::Write;

use module_core::{py_tuple, ExtraRepr, Module};

use super::Conv;
use crate::common::PerDim;

/// A convolution's settings as PyTorch's `_ConvNd.extra_repr` prints them, each per-dimension
/// value one entry per spatial dimension.
pub(crate) struct ConvRepr<'a> {
    /// `(in_channels, out_channels)`.
    pub channels: (usize, usize),
    pub kernel_size: &'a [usize],
    pub stride: Vec<usize>,
    pub padding: Vec<usize>,
    pub dilation: Vec<usize>,
    /// Empty for a forward convolution.
    pub output_padding: Vec<usize>,
    pub groups: usize,
    pub bias: bool,
}

impl ConvRepr<'_> {
    /// `3, 8, kernel_size=(3, 3), stride=(1, 1)`, then each setting that is not its default.
    pub(crate) fn text(&self) -> String {
        let mut s = format!("{}, {}", self.channels.0, self.channels.1);
        let _ = write!(s, ", kernel_size={}", py_tuple(self.kernel_size));
        let _ = write!(s, ", stride={}", py_tuple(&self.stride));
        let mut unless = |name: &str, values: &[usize], default: usize| {
            if values.iter().any(|&v| v != default) {
                let _ = write!(s, ", {name}={}", py_tuple(values));
            }
        };
        unless("padding", &self.padding, 0);
        unless("dilation", &self.dilation, 1);
        unless("output_padding", &self.output_padding, 0);
        if self.groups != 1 {
            let _ = write!(s, ", groups={}", self.groups);
        }
        if !self.bias {
            s.push_str(", bias=False");
        }
        s
    }
}

impl<const D: usize> ExtraRepr for Conv<D> {
    /// PyTorch's settings; with adapters, PEFT's `lora.Conv2d` body: the layer as
    /// `(base_layer)`, then the adapters' dictionaries.
    fn extra_repr(&self) -> String {
        let own = self.own_repr();
        if let Some(saved) = &self.modules_to_save {
            return saved.wrapped_repr(&format!("{}({own})", Self::type_class_name()));
        }
        match &self.lora {
            None => own,
            Some(lora) => lora.wrapped_repr(&format!("{}({own})", Self::type_class_name())),
        }
    }

    /// The adapters' children are printed by `extra_repr`, in PEFT's order.
    fn child_repr(&self, child: &str) -> module_core::ChildRepr {
        crate::peft::adapter_child_repr(child)
    }

    /// PEFT's `lora.Conv2d` with adapters, PyTorch's `ParametrizedConv2d` once a tensor is
    /// parametrized.
    fn class_repr(&self) -> Option<String> {
        let class = Self::type_class_name();
        if self.modules_to_save.is_some() {
            return Some("ModulesToSaveWrapper".into());
        }
        if self.lora.is_some() {
            return Some(format!("lora.{class}"));
        }
        (self.parametrizations.as_ref()).map(|_| format!("Parametrized{class}"))
    }
}

impl<const D: usize> Conv<D> {
    /// PyTorch's `_ConvNd.extra_repr` of the layer itself.
    fn own_repr(&self) -> String {
        let dims = self.weight.shape().dims().to_vec();
        let per_dim = |v: PerDim| v.for_dims::<D>().unwrap_or([0; D]).to_vec();
        let c = &self.config;
        ConvRepr {
            channels: (dims[1] * c.groups, dims[0]),
            kernel_size: &dims[2..],
            stride: per_dim(c.stride),
            padding: per_dim(c.padding),
            dilation: per_dim(c.dilation),
            output_padding: Vec::new(),
            groups: c.groups,
            bias: self.bias.is_some(),
        }
        .text()
    }
}
