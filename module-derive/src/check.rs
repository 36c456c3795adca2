//! Rules across fields and attributes, checked before anything is generated.

use std::collections::BTreeMap;

use crate::ast::{Data, Field, Input};
use crate::ctxt::Ctxt;

pub fn check(cx: &Ctxt, input: &Input) {
    for field in input.all_fields() {
        check_field(cx, field);
    }
    match &input.data {
        Data::Struct(fields) => check_names(cx, fields),
        Data::Enum(variants) => {
            for v in variants {
                check_names(cx, &v.fields);
            }
        }
    }
}

fn check_field(cx: &Ctxt, field: &Field) {
    let attrs = &field.attrs;
    if let Some(skip) = attrs.skip {
        if let Some((span, _)) = &attrs.rename {
            cx.syn_error(syn::Error::new(
                *span,
                "a skipped field has no name to `rename`; remove `rename`, or `skip` if the field is a module",
            ));
        }
        if let Some(span) = attrs.flatten {
            cx.syn_error(syn::Error::new(
                span,
                "`skip` and `flatten` contradict each other; keep one",
            ));
        }
        if let Some(leaf) = runtime_leaf(field.ty) {
            cx.syn_error(syn::Error::new(
                skip,
                format!(
                    "`#[module(skip)]` on a `{leaf}` would leave it out of training and checkpoints \
                     without a word; remove `skip` (to freeze it, call `freeze` on its path)"
                ),
            ));
        }
    } else if let (Some(span), Some(_)) = (attrs.flatten, &attrs.rename) {
        cx.syn_error(syn::Error::new(
            span,
            "a `flatten`ed field has no name of its own, so it cannot be `rename`d",
        ));
    }
}

/// `Param` and `Buffer`, recognized by their last path segment. This is a lint for the common
/// mistake, not a classification: everything else is classified by trait.
fn runtime_leaf(ty: &syn::Type) -> Option<&'static str> {
    let syn::Type::Path(path) = ty else {
        return None;
    };
    let last = path.path.segments.last()?;
    if !last.arguments.is_none() {
        return None;
    }
    ["Param", "Buffer"]
        .into_iter()
        .find(|name| last.ident == name)
}

/// Two fields may not end up with one path name.
fn check_names(cx: &Ctxt, fields: &[Field]) {
    let mut seen: BTreeMap<String, &Field> = BTreeMap::new();
    for field in fields {
        if field.attrs.skip.is_some() || field.attrs.flatten.is_some() {
            continue;
        }
        let name = field.path_name();
        if let Some(first) = seen.get(name.as_str()) {
            let span = field
                .attrs
                .rename
                .as_ref()
                .map_or(field.span, |(span, _)| *span);
            let first_name = match &first.member {
                syn::Member::Named(i) => format!("field `{i}`"),
                syn::Member::Unnamed(i) => format!("field {}", i.index),
            };
            cx.syn_error(syn::Error::new(
                span,
                format!("two fields are named `{name}` in paths: this one and {first_name}; `rename` one of them"),
            ));
        } else {
            seen.insert(name, field);
        }
    }
}
