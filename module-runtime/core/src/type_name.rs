//! Type names as messages and summaries show them: Rust names without module paths, and the class
//! names of generic types built from their type arguments' class names.
//!
//! Which class name a module type has is the type's own answer
//! ([`Module::type_class_name`](crate::Module::type_class_name)); this file only spells names
//! and knows no type.

/// `std::any::type_name` without module paths: `alloc::vec::Vec<my::Block>` → `Vec<Block>`.
///
/// This is the spelling of any type; a module's name as summaries and errors show it is its
/// [`class_name`](crate::Module::class_name), which is this by default and PyTorch's class name
/// for the runtime's generic layers (`BatchNorm<1>` is `BatchNorm1d`).
///
/// ```
/// use module_runtime::short_type_name;
/// assert_eq!(short_type_name("alloc::vec::Vec<my::Block>"), "Vec<Block>");
/// assert_eq!(
///     short_type_name("core::option::Option<(my::A, alloc::string::String)>"),
///     "Option<(A, String)>"
/// );
/// ```
pub fn short_type_name(full: &str) -> String {
    let mut out = String::with_capacity(full.len());
    let mut token_start = 0;
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

/// The class name of a generic type whose Rust name is `full`: `full` without module paths, with
/// each of `args` (a type argument's Rust name and its class name) shown as its class name.
///
/// This is how a container or a generic module composes its class name from its arguments':
/// `Vec<BatchNorm<1>>` is `Vec<BatchNorm1d>`. An argument is replaced only where its whole name
/// stands (not inside a longer path, nor as the head of another generic type).
///
/// ```
/// use module_runtime::generic_class_name;
/// let args = [("my::Norm<1>", "Norm1d".to_owned())];
/// assert_eq!(
///     generic_class_name("alloc::vec::Vec<my::Norm<1>>", &args),
///     "Vec<Norm1d>"
/// );
/// // Only an argument's whole name is replaced: `my::Norm<2>` is another type, and so is
/// // `my::Norm<1>x`.
/// assert_eq!(generic_class_name("my::Block<my::Norm<2>>", &args), "Block<Norm<2>>");
/// assert_eq!(generic_class_name("my::Pair<my::Norm<1>x>", &args), "Pair<Norm<1>x>");
/// ```
pub fn generic_class_name(full: &str, args: &[(&str, String)]) -> String {
    let mut out = String::with_capacity(full.len());
    let mut i = 0;
    'scan: while let Some(c) = full[i..].chars().next() {
        let starts_token = full[..i]
            .chars()
            .next_back()
            .is_none_or(|p| !is_path_char(p));
        if starts_token {
            for (rust, class) in args {
                let end = i + rust.len();
                let whole = full[i..].starts_with(rust)
                    && full[end..]
                        .chars()
                        .next()
                        .is_none_or(|n| !is_path_char(n) && n != '<');
                if !rust.is_empty() && whole {
                    out.push_str(class);
                    i = end;
                    continue 'scan;
                }
            }
        }
        out.push(c);
        i += c.len_utf8();
    }
    short_type_name(&out)
}

/// A character of a path token: `my_crate::Block2`.
fn is_path_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_' || c == ':'
}
