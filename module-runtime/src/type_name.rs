//! Type names as messages and summaries show them.

/// `std::any::type_name` without module paths: `alloc::vec::Vec<my::Block>` → `Vec<Block>`.
///
/// ```
/// use module_runtime::short_type_name;
/// assert_eq!(short_type_name("alloc::vec::Vec<my::Block>"), "Vec<Block>");
/// ```
pub fn short_type_name(full: &str) -> String {
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
