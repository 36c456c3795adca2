//! The attribute grammars: `#[module(...)]` (the `Module` derive) and `#[tensor(...)]` (the
//! `TensorStruct` derive).

use proc_macro2::Span;
use syn::meta::ParseNestedMeta;
use syn::spanned::Spanned;

use crate::ctxt::Ctxt;

const MODULE: &str = "module";
const TENSOR: &str = "tensor";
const CRATE: &str = "crate";
const BOUND: &str = "bound";
const SKIP: &str = "skip";
const RENAME: &str = "rename";
const FLATTEN: &str = "flatten";
const EXTRA_STATE: &str = "extra_state";
const PATHS: &str = "paths";
const EXTRA_REPR: &str = "extra_repr";
const NO_DISPLAY: &str = "no_display";
const CLASS_NAME: &str = "class_name";

/// A value set at most once, remembering where.
struct Attr<T> {
    name: &'static str,
    value: Option<(Span, T)>,
}

impl<T> Attr<T> {
    fn none(name: &'static str) -> Self {
        Self { name, value: None }
    }

    fn set(&mut self, cx: &Ctxt, span: Span, value: T) {
        if self.value.is_some() {
            cx.syn_error(syn::Error::new(
                span,
                format!("`{}` is given twice here; keep one", self.name),
            ));
        } else {
            self.value = Some((span, value));
        }
    }

    fn get(self) -> Option<(Span, T)> {
        self.value
    }
}

/// Attributes on the struct or enum.
pub struct Container {
    /// `crate = path`: where the runtime is (default `::module_runtime`).
    pub krate: Option<syn::Path>,
    /// `bound = "T: Module, ..."`: replaces the inferred bounds.
    pub bound: Option<Vec<syn::WherePredicate>>,
    /// `extra_state`: the type implements `ExtraState`, saved under `<path>._extra_state`.
    pub extra_state: Option<Span>,
    /// `paths`: also emit the typed path type (`FooPath`) and `Foo::path()`.
    pub paths: Option<Span>,
    /// `extra_repr`: the type implements `ExtraRepr`, shown inside its parentheses when printed.
    pub extra_repr: Option<Span>,
    /// `no_display`: no `Display` impl (the type has its own).
    pub no_display: Option<Span>,
    /// `class_name = <expr>`: the type's class name (`Module::type_class_name`), an expression
    /// that may use the type's parameters (`format!("Conv{D}d")`, `G::CLASS_NAME`).
    pub class_name: Option<syn::Expr>,
}

impl Container {
    pub fn from_ast(cx: &Ctxt, attrs: &[syn::Attribute]) -> Self {
        let mut krate = Attr::none(CRATE);
        let mut bound = Attr::none(BOUND);
        let mut extra_state = Attr::none(EXTRA_STATE);
        let mut paths = Attr::none(PATHS);
        let mut extra_repr = Attr::none(EXTRA_REPR);
        let mut no_display = Attr::none(NO_DISPLAY);
        let mut class_name = Attr::none(CLASS_NAME);
        for attr in module_attrs(attrs) {
            let result = attr.parse_nested_meta(|meta| {
                let span = meta.path.span();
                if meta.path.is_ident(CRATE) {
                    if let Some(path) = path_value(cx, &meta)? {
                        krate.set(cx, span, path);
                    }
                } else if meta.path.is_ident(BOUND) {
                    let example = "bound = \"T: Module\"";
                    if let Some(lit) = string_value(cx, &meta, example)? {
                        match parse_bound(&lit) {
                            Ok(predicates) => bound.set(cx, span, predicates),
                            Err(e) => cx.syn_error(e),
                        }
                    }
                } else if meta.path.is_ident(EXTRA_STATE) {
                    if meta.input.is_empty() || meta.input.peek(syn::Token![,]) {
                        extra_state.set(cx, span, ());
                    } else {
                        skip_value(&meta)?;
                        cx.syn_error(meta.error("`extra_state` takes no value"));
                    }
                } else if meta.path.is_ident(PATHS) {
                    if flag(cx, &meta)? {
                        paths.set(cx, span, ());
                    }
                } else if meta.path.is_ident(EXTRA_REPR) {
                    if flag(cx, &meta)? {
                        extra_repr.set(cx, span, ());
                    }
                } else if meta.path.is_ident(NO_DISPLAY) {
                    if flag(cx, &meta)? {
                        no_display.set(cx, span, ());
                    }
                } else if meta.path.is_ident(CLASS_NAME) {
                    if let Some(expr) = expr_value(cx, &meta, "class_name = \"RMSNorm\"")? {
                        class_name.set(cx, span, expr);
                    }
                } else if is_any(&meta, &[SKIP, RENAME, FLATTEN]) {
                    skip_value(&meta)?;
                    cx.syn_error(meta.error(format!(
                        "`{}` belongs on a field, not on the type",
                        path_name(&meta)
                    )));
                } else {
                    skip_value(&meta)?;
                    cx.syn_error(meta.error(format!(
                        "unknown `#[module(...)]` key `{}` on a type: expected `crate`, `bound`, `extra_state`, `extra_repr`, `paths`, `no_display` or `class_name`",
                        path_name(&meta)
                    )));
                }
                Ok(())
            });
            if let Err(e) = result {
                cx.syn_error(e);
            }
        }
        Self {
            krate: krate.get().map(|(_, p)| p),
            bound: bound.get().map(|(_, b)| b),
            extra_state: extra_state.get().map(|(span, ())| span),
            paths: paths.get().map(|(span, ())| span),
            extra_repr: extra_repr.get().map(|(span, ())| span),
            no_display: no_display.get().map(|(span, ())| span),
            class_name: class_name.get().map(|(_, expr)| expr),
        }
    }
}

fn parse_bound(lit: &syn::LitStr) -> syn::Result<Vec<syn::WherePredicate>> {
    let parser =
        syn::punctuated::Punctuated::<syn::WherePredicate, syn::Token![,]>::parse_terminated;
    syn::parse::Parser::parse_str(parser, &lit.value())
        .map(|p| p.into_iter().collect())
        .map_err(|e| {
            syn::Error::new(
                lit.span(),
                format!("malformed `bound`: {e}; expected where-clause predicates such as \"T: Module\""),
            )
        })
}

/// Attributes on a field.
pub struct Field {
    /// `skip`: not part of the module (configuration, caches).
    pub skip: Option<Span>,
    /// `rename = "LayerNorm"`: the field's name in paths and checkpoints.
    pub rename: Option<(Span, String)>,
    /// `flatten`: the field's children appear at this level.
    pub flatten: Option<Span>,
}

impl Field {
    pub fn from_ast(cx: &Ctxt, attrs: &[syn::Attribute]) -> Self {
        let mut skip = Attr::none(SKIP);
        let mut rename = Attr::none(RENAME);
        let mut flatten = Attr::none(FLATTEN);
        for attr in module_attrs(attrs) {
            let result = attr.parse_nested_meta(|meta| {
                let span = meta.path.span();
                if meta.path.is_ident(SKIP) {
                    if flag(cx, &meta)? {
                        skip.set(cx, span, ());
                    }
                } else if meta.path.is_ident(FLATTEN) {
                    if flag(cx, &meta)? {
                        flatten.set(cx, span, ());
                    }
                } else if meta.path.is_ident(RENAME) {
                    let example = "rename = \"LayerNorm\"";
                    if let Some(lit) = string_value(cx, &meta, example)? {
                        let name = lit.value();
                        if name.is_empty() || name.contains('.') {
                            cx.error_spanned_by(
                                &lit,
                                "a `rename` must be one non-empty path segment (no `.`): the \
                                 field's own name in its parent's checkpoint keys",
                            );
                        }
                        rename.set(cx, span, (lit.span(), name));
                    }
                } else if is_any(&meta, &[CRATE, BOUND, EXTRA_STATE, PATHS, CLASS_NAME]) {
                    skip_value(&meta)?;
                    cx.syn_error(meta.error(format!(
                        "`{}` belongs on the type, not on a field",
                        path_name(&meta)
                    )));
                } else {
                    skip_value(&meta)?;
                    cx.syn_error(meta.error(format!(
                        "unknown `#[module(...)]` key `{}` on a field: expected `skip`, `rename = \"...\"` or `flatten`",
                        path_name(&meta)
                    )));
                }
                Ok(())
            });
            if let Err(e) = result {
                cx.syn_error(e);
            }
        }
        Self {
            skip: skip.get().map(|(s, ())| s),
            rename: rename.get().map(|(_, r)| r),
            flatten: flatten.get().map(|(s, ())| s),
        }
    }
}

/// `#[tensor(...)]` on a field of a `#[derive(TensorStruct)]` struct.
pub struct TensorField {
    /// `skip`: a plain value, carried over unchanged (not a tensor tree).
    pub skip: Option<Span>,
}

impl TensorField {
    pub fn from_ast(cx: &Ctxt, attrs: &[syn::Attribute]) -> Self {
        let mut skip = Attr::none(SKIP);
        for attr in attrs.iter().filter(|a| a.path().is_ident(TENSOR)) {
            let result = attr.parse_nested_meta(|meta| {
                if meta.path.is_ident(SKIP)
                    && (meta.input.is_empty() || meta.input.peek(syn::Token![,]))
                {
                    skip.set(cx, meta.path.span(), ());
                } else {
                    skip_value(&meta)?;
                    cx.syn_error(meta.error(
                        "unknown `#[tensor(...)]` argument: the only one is `skip` (a plain value \
                         carried over unchanged)",
                    ));
                }
                Ok(())
            });
            if let Err(e) = result {
                cx.syn_error(e);
            }
        }
        Self {
            skip: skip.get().map(|(s, ())| s),
        }
    }
}

/// `#[tensor(...)]` belongs on fields: reports any on the type.
pub fn reject_tensor_type_attrs(cx: &Ctxt, attrs: &[syn::Attribute]) {
    for attr in attrs.iter().filter(|a| a.path().is_ident(TENSOR)) {
        cx.error_spanned_by(
            attr,
            "`#[tensor(...)]` goes on fields (`#[tensor(skip)]`), not on the type",
        );
    }
}

/// Enum variants take no attributes: reports any.
pub fn reject_variant_attrs(cx: &Ctxt, attrs: &[syn::Attribute]) {
    for attr in module_attrs(attrs) {
        cx.error_spanned_by(
            attr,
            "`#[module(...)]` is not supported on enum variants; put attributes on their fields",
        );
    }
}

fn module_attrs(attrs: &[syn::Attribute]) -> impl Iterator<Item = &syn::Attribute> {
    attrs.iter().filter(|a| a.path().is_ident(MODULE))
}

fn is_any(meta: &ParseNestedMeta, names: &[&str]) -> bool {
    names.iter().any(|n| meta.path.is_ident(n))
}

fn path_name(meta: &ParseNestedMeta) -> String {
    let path = &meta.path;
    quote::quote!(#path).to_string().replace(' ', "")
}

/// A key without a value (`skip`, `flatten`): whether it was written so. A value is reported
/// and consumed, and the key is then ignored.
fn flag(cx: &Ctxt, meta: &ParseNestedMeta) -> syn::Result<bool> {
    if meta.input.is_empty() || meta.input.peek(syn::Token![,]) {
        return Ok(true);
    }
    let name = path_name(meta);
    skip_value(meta)?;
    cx.syn_error(meta.error(format!(
        "`{name}` takes no value: write `#[module({name})]`"
    )));
    Ok(false)
}

/// The string after `key =`. Anything else is reported (showing `example`) and consumed.
fn string_value(
    cx: &Ctxt,
    meta: &ParseNestedMeta,
    example: &str,
) -> syn::Result<Option<syn::LitStr>> {
    let name = path_name(meta);
    let message = format!("`{name}` takes a string: `{example}`");
    if !meta.input.peek(syn::Token![=]) {
        skip_value(meta)?;
        cx.syn_error(meta.error(message));
        return Ok(None);
    }
    let value = meta.value()?;
    if value.peek(syn::LitStr) {
        return value.parse().map(Some);
    }
    let other: syn::Expr = value.parse()?;
    cx.error_spanned_by(other, message);
    Ok(None)
}

/// The expression after `key =`. Without `=`, the key is reported (showing `example`) and its
/// value consumed.
fn expr_value(cx: &Ctxt, meta: &ParseNestedMeta, example: &str) -> syn::Result<Option<syn::Expr>> {
    if !meta.input.peek(syn::Token![=]) {
        let name = path_name(meta);
        skip_value(meta)?;
        cx.syn_error(meta.error(format!("`{name}` takes a value: `{example}`")));
        return Ok(None);
    }
    meta.value()?.parse().map(Some)
}

/// The path after `crate =`. Anything else (a string, as serde takes) is reported and consumed.
fn path_value(cx: &Ctxt, meta: &ParseNestedMeta) -> syn::Result<Option<syn::Path>> {
    if !meta.input.peek(syn::Token![=]) {
        skip_value(meta)?;
        cx.syn_error(meta.error("`crate` takes a path: `crate = module_runtime`"));
        return Ok(None);
    }
    let value = meta.value()?;
    if value.peek(syn::LitStr) {
        let lit: syn::LitStr = value.parse()?;
        cx.error_spanned_by(
            lit,
            "`crate` takes a path, not a string: `crate = module_runtime`",
        );
        return Ok(None);
    }
    value.parse().map(Some)
}

/// Consumes `= value` or `(...)` after an unknown or misused key, so the rest of the list still
/// parses.
fn skip_value(meta: &ParseNestedMeta) -> syn::Result<()> {
    if meta.input.peek(syn::Token![=]) {
        let _: proc_macro2::TokenStream = meta
            .value()?
            .parse::<syn::Expr>()
            .map(|e| quote::quote!(#e))?;
    } else if meta.input.peek(syn::token::Paren) {
        // Whatever is inside, as tokens: it need not be attribute syntax (`bound(T: Module)`).
        let content;
        syn::parenthesized!(content in meta.input);
        content.parse::<proc_macro2::TokenStream>()?;
    }
    Ok(())
}
