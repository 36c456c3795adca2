//! Rules across fields and attributes, checked before anything is generated: the `Module`
//! derive's ([`check`]) and the `TensorStruct` derive's ([`tensor_struct_fields`]).

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
        if let Some(leaf) = held_leaf(field.ty) {
            let what = if is_leaf(field.ty).is_some() {
                format!("a `{leaf}`")
            } else {
                format!("a field that holds a `{leaf}`")
            };
            cx.syn_error(syn::Error::new(
                skip,
                format!(
                    "`#[module(skip)]` on {what} would leave it out of training and checkpoints \
                     without a word; remove `skip` (to freeze it, call `freeze` on its path)"
                ),
            ));
        }
    } else if let Some(span) = attrs.flatten {
        if attrs.rename.is_some() {
            cx.syn_error(syn::Error::new(
                span,
                "a `flatten`ed field has no name of its own, so it cannot be `rename`d",
            ));
        }
        if let Some(leaf) = flattened_leaf(field.ty) {
            cx.syn_error(syn::Error::new(
                span,
                format!(
                    "a `{leaf}` has no children to lift, so `flatten` would leave it out of \
                     training and checkpoints without a word; remove `flatten` (the field is then \
                     listed under its own name)"
                ),
            ));
        }
    }
}

/// `Param` and `Buffer`, recognized by their last path segment. This is a lint for the common
/// mistake, not a classification: everything else is classified by trait. The derive only sees
/// tokens, so a type alias of `Param` (or of `Option<Param>`) is not recognized.
fn is_leaf(ty: &syn::Type) -> Option<&'static str> {
    let syn::Type::Path(path) = ungroup(ty) else {
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

fn ungroup(mut ty: &syn::Type) -> &syn::Type {
    loop {
        match ty {
            syn::Type::Group(g) => ty = &g.elem,
            syn::Type::Paren(p) => ty = &p.elem,
            _ => return ty,
        }
    }
}

/// A `Param` or `Buffer` anywhere in the type: the type itself, or a generic argument, array,
/// slice or tuple element at any depth (`Option<Param>`, `Vec<Buffer>`, `[Param; 2]`,
/// `Arc<Mutex<Param>>`, `(usize, Buffer)`), recognized by the last segment of a path, as
/// [`is_leaf`] does. `PhantomData<…>` holds nothing, and function pointer types are not looked
/// into.
fn held_leaf(ty: &syn::Type) -> Option<&'static str> {
    if let Some(leaf) = is_leaf(ty) {
        return Some(leaf);
    }
    match ungroup(ty) {
        syn::Type::Path(path) => {
            if path.path.segments.last()?.ident == "PhantomData" {
                return None;
            }
            let qself = path.qself.as_ref().and_then(|q| held_leaf(&q.ty));
            qself.or_else(|| {
                path.path
                    .segments
                    .iter()
                    .find_map(|segment| match &segment.arguments {
                        syn::PathArguments::AngleBracketed(args) => {
                            args.args.iter().find_map(|arg| match arg {
                                syn::GenericArgument::Type(ty) => held_leaf(ty),
                                syn::GenericArgument::AssocType(assoc) => held_leaf(&assoc.ty),
                                _ => None,
                            })
                        }
                        _ => None,
                    })
            })
        }
        syn::Type::Array(a) => held_leaf(&a.elem),
        syn::Type::Slice(s) => held_leaf(&s.elem),
        syn::Type::Tuple(t) => t.elems.iter().find_map(held_leaf),
        syn::Type::Reference(r) => held_leaf(&r.elem),
        syn::Type::Ptr(p) => held_leaf(&p.elem),
        _ => None,
    }
}

/// A `Param` or `Buffer`, possibly in `Option`, `Box` or `Arc` (which are transparent: they walk
/// what they hold as that value's own children, and a leaf has none). Containers that name their
/// elements (`Vec<Param>`, arrays, tuples) flatten fine: their elements are lifted as `0`, `1`, ….
fn flattened_leaf(ty: &syn::Type) -> Option<&'static str> {
    if let Some(leaf) = is_leaf(ty) {
        return Some(leaf);
    }
    let syn::Type::Path(path) = ungroup(ty) else {
        return None;
    };
    let last = path.path.segments.last()?;
    if !["Option", "Box", "Arc"].iter().any(|w| last.ident == w) {
        return None;
    }
    let syn::PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.first()? {
        syn::GenericArgument::Type(inner) if args.args.len() == 1 => flattened_leaf(inner),
        _ => None,
    }
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

/// `#[derive(TensorStruct)]` takes structs only: the struct's fields, or `None` with the error for
/// an enum or a union.
pub fn tensor_struct_fields<'a>(cx: &Ctxt, input: &'a syn::DeriveInput) -> Option<&'a syn::Fields> {
    match &input.data {
        syn::Data::Struct(s) => Some(&s.fields),
        syn::Data::Enum(e) => {
            cx.error_spanned_by(
                e.enum_token,
                "`#[derive(TensorStruct)]` supports structs only: hooks rebuild a value from its \
                 tensors, which must not depend on a variant; write the `TensorStruct` impl by hand",
            );
            None
        }
        syn::Data::Union(u) => {
            cx.error_spanned_by(
                u.union_token,
                "`#[derive(TensorStruct)]` does not support unions: a walk cannot know which field \
                 is live; use a struct",
            );
            None
        }
    }
}
