//! The generated impl's generics and where clause.

use std::collections::BTreeSet;

use quote::quote_spanned;
use syn::spanned::Spanned;

use crate::ast::Input;

/// The impl's generics: the input's, plus `Field: Module` for every walked field whose type mentions
/// a type parameter (per field type, not per parameter, as thiserror does), `Field: Send + Sync +
/// 'static` for skipped ones, and `'static` for every parameter (modules are `Any`). With
/// `#[module(bound = "...")]`, the user's predicates replace the inferred field bounds.
pub fn with_bounds(input: &Input, krate: &syn::Path) -> syn::Generics {
    let (mut generics, params) = all_static(input.generics);
    let where_clause = generics.make_where_clause();
    match &input.attrs.bound {
        Some(predicates) => where_clause.predicates.extend(predicates.iter().cloned()),
        None => {
            let mut seen = BTreeSet::new();
            for field in input.all_fields() {
                let ty = field.ty;
                if !mentions_any(ty, &params) || !seen.insert(quote::quote!(#ty).to_string()) {
                    continue;
                }
                let predicate = if field.attrs.skip.is_some() {
                    quote_spanned!(ty.span()=> #ty: ::core::marker::Send + ::core::marker::Sync + 'static)
                } else {
                    quote_spanned!(ty.span()=> #ty: #krate::Module)
                };
                where_clause.predicates.push(syn::parse_quote!(#predicate));
            }
        }
    }
    generics
}

/// `generics` with `'static` required of every lifetime and type parameter (derived impls are for
/// `Any` types), and the names of the type parameters, for [`mentions_any`].
pub fn all_static(generics: &syn::Generics) -> (syn::Generics, BTreeSet<String>) {
    let mut generics = generics.clone();
    let params: BTreeSet<String> = generics
        .type_params()
        .map(|p| p.ident.to_string())
        .collect();
    let lifetimes: Vec<syn::Lifetime> = generics.lifetimes().map(|l| l.lifetime.clone()).collect();
    let type_params: Vec<syn::Ident> = generics.type_params().map(|p| p.ident.clone()).collect();
    let where_clause = generics.make_where_clause();
    for lifetime in lifetimes {
        where_clause
            .predicates
            .push(syn::parse_quote!(#lifetime: 'static));
    }
    for param in type_params {
        where_clause
            .predicates
            .push(syn::parse_quote!(#param: 'static));
    }
    (generics, params)
}

/// Whether `ty` names one of `params` anywhere (as a path segment: `T`, `Vec<T>`, `T::Assoc`).
pub fn mentions_any(ty: &syn::Type, params: &BTreeSet<String>) -> bool {
    if params.is_empty() {
        return false;
    }
    fn walk(tokens: proc_macro2::TokenStream, params: &BTreeSet<String>) -> bool {
        tokens.into_iter().any(|tt| match tt {
            proc_macro2::TokenTree::Ident(i) => params.contains(&i.to_string()),
            proc_macro2::TokenTree::Group(g) => walk(g.stream(), params),
            _ => false,
        })
    }
    walk(quote::quote!(#ty), params)
}
