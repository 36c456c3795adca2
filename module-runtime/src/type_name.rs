//! Type names as messages and summaries show them.

/// `std::any::type_name` without module paths: `alloc::vec::Vec<my::Block>` → `Vec<Block>`.
///
/// The runtime's generic layers get PyTorch's class names: `BatchNorm<1>` is `BatchNorm1d`,
/// `Conv<2>` is `Conv2d`, `Pool2d<Max>` is `MaxPool2d`, `RnnBase<LstmGates>` is `LSTM` (and so on
/// for every alias in [`nn`](crate::nn)), wherever they appear in the name.
///
/// ```
/// use module_runtime::short_type_name;
/// use module_runtime::nn::{BatchNorm1d, MaxPool2d};
/// assert_eq!(short_type_name("alloc::vec::Vec<my::Block>"), "Vec<Block>");
/// assert_eq!(short_type_name(std::any::type_name::<BatchNorm1d>()), "BatchNorm1d");
/// assert_eq!(short_type_name(std::any::type_name::<Vec<MaxPool2d>>()), "Vec<MaxPool2d>");
/// ```
pub fn short_type_name(full: &str) -> String {
    // Upward use: the layers' names live with the layers (`nn`).
    let mut renamed = None;
    for (rust, pytorch) in crate::nn::pytorch_names() {
        let current: &str = renamed.as_deref().unwrap_or(full);
        if current.contains(rust) {
            renamed = Some(current.replace(rust, pytorch));
        }
    }
    strip_paths(renamed.as_deref().unwrap_or(full))
}

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
