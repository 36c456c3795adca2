//! `#[module(paths)]`: the typed path type of a derived module (`FooPath<R, K>`), one inherent
//! method per field, `Foo::path()` and `Foo::get(path)`. The semantics (kinds, containers,
//! resolution) are in `module_runtime::typed_path`; this emits only the per-field methods and the
//! glue impls.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;

use crate::ast::{Data, Field, Input, Style};

pub fn expand(input: &Input, krate: &syn::Path) -> TokenStream {
    let ident = input.ident;
    let vis = input.vis;
    let tp = quote!(#krate::typed_path);
    let path_ident = format_ident!("{}Path", ident);
    let r = syn::Ident::new("__R", Span::mixed_site());
    let k = syn::Ident::new("__K", Span::mixed_site());

    let (orig_impl, orig_ty, _) = input.generics.split_for_impl();
    let mut generics = input.generics.clone();
    let lifetimes = generics.lifetimes().count();
    generics
        .params
        .insert(lifetimes, syn::parse_quote!(#k: #tp::PathKind));
    generics
        .params
        .insert(lifetimes, syn::parse_quote!(#r: 'static));
    let (impl_g, _, where_clause) = generics.split_for_impl();
    // `FooPath<.., R, K, ..>` with other arguments for `R` and `K`.
    let path_ty = |root: TokenStream, kind: TokenStream| {
        let args = generics.params.iter().map(|p| match p {
            syn::GenericParam::Lifetime(l) => {
                let l = &l.lifetime;
                quote!(#l)
            }
            syn::GenericParam::Type(t) if t.ident == r => root.clone(),
            syn::GenericParam::Type(t) if t.ident == k => kind.clone(),
            syn::GenericParam::Type(t) => {
                let t = &t.ident;
                quote!(#t)
            }
            syn::GenericParam::Const(c) => {
                let c = &c.ident;
                quote!(#c)
            }
        });
        quote!(#path_ident<#(#args),*>)
    };
    let target = quote!(#ident #orig_ty);
    let mut static_where = input
        .generics
        .where_clause
        .clone()
        .unwrap_or_else(|| syn::parse_quote!(where));
    static_where
        .predicates
        .push(syn::parse_quote!(#target: 'static));
    let mut path_where = where_clause
        .cloned()
        .unwrap_or_else(|| syn::parse_quote!(where));
    path_where
        .predicates
        .push(syn::parse_quote!(#target: 'static));

    let methods: Vec<TokenStream> = match &input.data {
        Data::Struct(fields) => fields
            .iter()
            .filter(|f| f.attrs.skip.is_none())
            .map(|f| {
                let name = match &f.member {
                    syn::Member::Named(i) => i.clone(),
                    syn::Member::Unnamed(i) => format_ident!("_{}", i.index),
                };
                let kind = quote!(<#k as #tp::PathKind>::Field);
                method(f, &name, kind, vis, &tp, &r, false)
            })
            .collect(),
        Data::Enum(variants) => variants
            .iter()
            .flat_map(|v| {
                let snake = snake_case(&v.ident.to_string());
                let transparent = v.style == Style::Tuple
                    && v.fields.len() == 1
                    && v.fields[0].attrs.skip.is_none()
                    && v.fields[0].attrs.rename.is_none()
                    && v.fields[0].attrs.flatten.is_none();
                let tp = &tp;
                let r = &r;
                let k = &k;
                v.fields
                    .iter()
                    .filter(|f| f.attrs.skip.is_none())
                    .map(move |f| {
                        if transparent {
                            let name = ident_of(&snake, v.ident.span());
                            let kind = quote!(<#k as #tp::PathKind>::Checked);
                            return method(f, &name, kind, vis, tp, r, true);
                        }
                        let member = match &f.member {
                            syn::Member::Named(i) => {
                                use syn::ext::IdentExt;
                                i.unraw().to_string()
                            }
                            syn::Member::Unnamed(i) => i.index.to_string(),
                        };
                        let name = ident_of(&format!("{snake}_{member}"), f.span);
                        let kind = quote!(#tp::Indexed<#k>);
                        method(f, &name, kind, vis, tp, r, false)
                    })
            })
            .collect(),
    };

    let doc_struct = format!(
        "Typed paths into a [`{ident}`] (from `#[module(paths)]`): one method per field, \
         starting from [`{ident}::path()`]. `R` is the root type, `K` the \
         [`PathKind`]({}::typed_path::PathKind). Dereferences to \
         [`Path`]({}::typed_path::Path), and so to `str`, the state-dict path.",
        "module_runtime", "module_runtime"
    );
    let doc_root = format!(
        "The typed path of a [`{ident}`] itself (the empty path): navigate from it with the \
         methods of [`{path_ident}`]; its string form is the state-dict path."
    );
    let root_ty = path_ty(quote!(Self), quote!(#tp::Static));
    let self_ty = path_ty(quote!(#r), quote!(#k));

    quote! {
        #[doc = #doc_struct]
        #[allow(dead_code)]
        #vis struct #path_ident #generics #where_clause {
            __path: #tp::Path<#r, #k, #target>,
        }

        #[automatically_derived]
        impl #impl_g ::core::clone::Clone for #self_ty #where_clause {
            fn clone(&self) -> Self {
                Self { __path: ::core::clone::Clone::clone(&self.__path) }
            }
        }

        #[automatically_derived]
        impl #impl_g ::core::ops::Deref for #self_ty #where_clause {
            type Target = #tp::Path<#r, #k, #target>;
            fn deref(&self) -> &Self::Target {
                &self.__path
            }
        }

        #[automatically_derived]
        impl #impl_g ::core::fmt::Display for #self_ty #where_clause {
            fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                ::core::fmt::Display::fmt(&self.__path, f)
            }
        }

        #[automatically_derived]
        impl #impl_g #tp::FromPathString for #self_ty #where_clause {
            fn __from_path_string(path: ::std::string::String) -> Self {
                Self { __path: #tp::FromPathString::__from_path_string(path) }
            }
        }

        #[automatically_derived]
        impl #impl_g #tp::TypedPath for #self_ty #path_where {
            type Root = #r;
            type Target = #target;
            type Kind = #k;
            fn as_str(&self) -> &str {
                self.__path.as_str()
            }
        }

        #[automatically_derived]
        impl #orig_impl #tp::HasPath for #target #static_where {
            type Path<#r: 'static, #k: #tp::PathKind> = #self_ty;
        }

        #[automatically_derived]
        #[allow(dead_code)]
        impl #orig_impl #target #static_where {
            #[doc = #doc_root]
            #vis fn path() -> #root_ty {
                #tp::__root()
            }

            /// The module (or parameter, or buffer) a typed path from this type leads to: `&T`
            /// for a path that always exists, `Option<&T>` for one through an index, a key or an
            /// `Option`, every match for a pattern (`each()`).
            #vis fn get<__P>(
                &self,
                path: __P,
            ) -> <<__P as #tp::TypedPath>::Kind as #tp::Resolve>::Output<'_, <__P as #tp::TypedPath>::Target>
            where
                __P: #tp::TypedPath<Root = Self>,
                <__P as #tp::TypedPath>::Kind: #tp::Resolve,
                Self: #krate::Module + ::core::marker::Sized,
            {
                #tp::PathExt::get(self, path)
            }

            /// [`get`](Self::get), mutably: `&mut T`, `Option<&mut T>` or every match; not
            /// offered for a path through an `Arc`, which has no `&mut`.
            #vis fn get_mut<__P>(
                &mut self,
                path: __P,
            ) -> <<__P as #tp::TypedPath>::Kind as #tp::ResolveMut>::OutputMut<'_, <__P as #tp::TypedPath>::Target>
            where
                __P: #tp::TypedPath<Root = Self>,
                <__P as #tp::TypedPath>::Kind: #tp::ResolveMut,
                Self: #krate::Module + ::core::marker::Sized,
            {
                #tp::PathExt::get_mut(self, path)
            }
        }

        #[automatically_derived]
        #[allow(dead_code, private_interfaces, private_bounds)]
        impl #impl_g #self_ty #where_clause {
            #(#methods)*
        }
    }
}

/// One field's path method. `same` keeps the parent's string (transparent enum variants).
fn method(
    field: &Field,
    name: &syn::Ident,
    kind: TokenStream,
    vis: &syn::Visibility,
    tp: &TokenStream,
    r: &syn::Ident,
    same: bool,
) -> TokenStream {
    let ty = field.ty;
    let span = ty.span();
    let flatten = field.attrs.flatten.is_some();
    let segment = field.path_name();
    let (kind, body, doc) = if flatten {
        (
            quote!(#tp::Flat<#kind>),
            quote!(::std::string::ToString::to_string(self.__path.as_str())),
            format!(
                "The path of the `#[module(flatten)]` field `{}`: the same string as this one's \
                 (a flattened field adds no segment), as a prefix for its children.",
                name
            ),
        )
    } else if same {
        (
            kind,
            quote!(::std::string::ToString::to_string(self.__path.as_str())),
            format!(
                "The path of the module inside the variant that `{name}` names (the variant \
                 adds no segment; [`get`](#method.get) checks that it is the one built)."
            ),
        )
    } else {
        (
            kind,
            quote!(#tp::__child_name(self.__path.as_str(), #segment)),
            format!("The path of the field `{name}`: segment `{segment}`."),
        )
    };
    let ret = quote_spanned!(span=> <#ty as #tp::HasPath>::Path<#r, #kind>);
    let bound = quote_spanned!(span=> #ty: #tp::HasPath);
    quote! {
        #[doc = #doc]
        #[inline]
        #vis fn #name(&self) -> #ret where #bound {
            #tp::FromPathString::__from_path_string(#body)
        }
    }
}

fn ident_of(name: &str, span: Span) -> syn::Ident {
    if syn::parse_str::<syn::Ident>(name).is_ok() {
        syn::Ident::new(name, span)
    } else {
        syn::Ident::new_raw(name, span)
    }
}

/// `MyVariant` -> `my_variant`.
fn snake_case(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.extend(c.to_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}
