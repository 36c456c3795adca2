//! Type names as messages and summaries show them.

/// `std::any::type_name` without module paths: `alloc::vec::Vec<my::Block>` → `Vec<Block>`.
///
/// The runtime's generic layers get PyTorch's class names: `BatchNorm<1>` is `BatchNorm1d`,
/// `Conv<2>` is `Conv2d`, `Pool2d<Max>` is `MaxPool2d`, `RnnBase<LstmGates>` is `LSTM` (and so on
/// for every alias in [`nn`](../module_runtime/nn/index.html)), wherever they appear in the name.
///
/// ```
/// use module_runtime::short_type_name;
/// use module_runtime::nn::{BatchNorm1d, MaxPool2d};
/// assert_eq!(short_type_name("alloc::vec::Vec<my::Block>"), "Vec<Block>");
/// assert_eq!(short_type_name(std::any::type_name::<BatchNorm1d>()), "BatchNorm1d");
/// assert_eq!(short_type_name(std::any::type_name::<Vec<MaxPool2d>>()), "Vec<MaxPool2d>");
/// ```
pub fn short_type_name(full: &str) -> String {
    let mut renamed = None;
    for (rust, pytorch) in PYTORCH_NAMES {
        let current: &str = renamed.as_deref().unwrap_or(full);
        if current.contains(rust) {
            renamed = Some(current.replace(rust, pytorch));
        }
    }
    strip_paths(renamed.as_deref().unwrap_or(full))
}

/// The layer crate's path, as `std::any::type_name` spells the layers' names.
macro_rules! nn {
    ($($path:literal),+) => {
        concat!($("module_nn::", $path),+)
    };
}

/// The runtime's generic layers, as `std::any::type_name` spells each instantiation, and
/// PyTorch's class names for them (`RmsNorm` too, which PyTorch spells `RMSNorm`). The layers
/// live above this crate, so the names are strings here; a test beside the layers checks every
/// entry against `type_name` of its alias.
#[doc(hidden)]
pub const PYTORCH_NAMES: [(&str, &str); 48] = [
    (nn!("batch_norm::BatchNorm<1>"), "BatchNorm1d"),
    (nn!("batch_norm::BatchNorm<2>"), "BatchNorm2d"),
    (nn!("batch_norm::LazyBatchNorm<1>"), "LazyBatchNorm1d"),
    (nn!("batch_norm::LazyBatchNorm<2>"), "LazyBatchNorm2d"),
    (nn!("conv::Conv<1>"), "Conv1d"),
    (nn!("conv::Conv<2>"), "Conv2d"),
    (nn!("conv::Conv<3>"), "Conv3d"),
    (nn!("conv::lazy::LazyConv<1>"), "LazyConv1d"),
    (nn!("conv::lazy::LazyConv<2>"), "LazyConv2d"),
    (nn!("conv::transpose::ConvTranspose<1>"), "ConvTranspose1d"),
    (nn!("conv::transpose::ConvTranspose<2>"), "ConvTranspose2d"),
    (nn!("pool::Pool2d<", "pool::Max>"), "MaxPool2d"),
    (nn!("pool::Pool2d<", "pool::Avg>"), "AvgPool2d"),
    (
        nn!("rnn::sequence::RnnBase<", "rnn::gates::LstmGates>"),
        "LSTM",
    ),
    (
        nn!("rnn::sequence::RnnBase<", "rnn::gates::GruGates>"),
        "GRU",
    ),
    (
        nn!("rnn::cell::RnnCellBase<", "rnn::gates::LstmGates>"),
        "LSTMCell",
    ),
    (
        nn!("rnn::cell::RnnCellBase<", "rnn::gates::GruGates>"),
        "GRUCell",
    ),
    (nn!("layer_norm::RmsNorm"), "RMSNorm"),
    (
        nn!("adaptive_pool::AdaptivePool<1, ", "pool::Avg>"),
        "AdaptiveAvgPool1d",
    ),
    (
        nn!("adaptive_pool::AdaptivePool<2, ", "pool::Avg>"),
        "AdaptiveAvgPool2d",
    ),
    (
        nn!("adaptive_pool::AdaptivePool<1, ", "pool::Max>"),
        "AdaptiveMaxPool1d",
    ),
    (
        nn!("adaptive_pool::AdaptivePool<2, ", "pool::Max>"),
        "AdaptiveMaxPool2d",
    ),
    (nn!("instance_norm::InstanceNorm<1>"), "InstanceNorm1d"),
    (nn!("instance_norm::InstanceNorm<2>"), "InstanceNorm2d"),
    (nn!("pool1d::Pool1d<", "pool::Max>"), "MaxPool1d"),
    (nn!("pool1d::Pool1d<", "pool::Avg>"), "AvgPool1d"),
    (nn!("pool1d::LpPool<1>"), "LPPool1d"),
    (nn!("pool1d::LpPool<2>"), "LPPool2d"),
    (
        nn!(
            "transformer::stack::TransformerStack<",
            "transformer::encoder::TransformerEncoderLayer>"
        ),
        "TransformerEncoder",
    ),
    (
        nn!(
            "transformer::stack::TransformerStack<",
            "transformer::decoder::TransformerDecoderLayer>"
        ),
        "TransformerDecoder",
    ),
    (nn!("padding::Pad<1, ", "padding::Zeros>"), "ZeroPad1d"),
    (nn!("padding::Pad<2, ", "padding::Zeros>"), "ZeroPad2d"),
    (nn!("padding::Pad<3, ", "padding::Zeros>"), "ZeroPad3d"),
    (
        nn!("padding::Pad<1, ", "padding::Constant>"),
        "ConstantPad1d",
    ),
    (
        nn!("padding::Pad<2, ", "padding::Constant>"),
        "ConstantPad2d",
    ),
    (
        nn!("padding::Pad<3, ", "padding::Constant>"),
        "ConstantPad3d",
    ),
    (
        nn!("padding::Pad<1, ", "padding::Reflect>"),
        "ReflectionPad1d",
    ),
    (
        nn!("padding::Pad<2, ", "padding::Reflect>"),
        "ReflectionPad2d",
    ),
    (
        nn!("padding::Pad<3, ", "padding::Reflect>"),
        "ReflectionPad3d",
    ),
    (
        nn!("padding::Pad<1, ", "padding::Replicate>"),
        "ReplicationPad1d",
    ),
    (
        nn!("padding::Pad<2, ", "padding::Replicate>"),
        "ReplicationPad2d",
    ),
    (
        nn!("padding::Pad<3, ", "padding::Replicate>"),
        "ReplicationPad3d",
    ),
    (
        nn!("padding::Pad<1, ", "padding::Circular>"),
        "CircularPad1d",
    ),
    (
        nn!("padding::Pad<2, ", "padding::Circular>"),
        "CircularPad2d",
    ),
    (
        nn!("padding::Pad<3, ", "padding::Circular>"),
        "CircularPad3d",
    ),
    (nn!("dropout_variants::ChannelDropout<1>"), "Dropout1d"),
    (nn!("dropout_variants::ChannelDropout<2>"), "Dropout2d"),
    (nn!("dropout_variants::ChannelDropout<3>"), "Dropout3d"),
];

fn strip_paths(full: &str) -> String {
    let mut out = String::with_capacity(full.len());
    let mut token_start = 0;
    let is_path_char = |c: char| c.is_alphanumeric() || c == '_' || c == ':';
    for (i, c) in full
        .char_indices()
        .chain(std::iter::once((full.len(), ' ')))
    {
        if i < full.len() && is_path_char(c) {
            continue;
        }
        let token = &full[token_start..i];
        out.push_str(token.rsplit("::").next().unwrap_or(token));
        if i < full.len() {
            out.push(c);
        }
        token_start = i + c.len_utf8();
    }
    out
}
