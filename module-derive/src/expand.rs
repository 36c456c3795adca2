//! Code generation: `visit_children`, `visit_children_mut`, and for enums `as_child`.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::ext::IdentExt;
use syn::spanned::Spanned;

use crate::ast::{Data, Field, Input, Style, Variant};
use crate::ctxt::Ctxt;
use crate::{bound, check};

/// The whole derive on `proc_macro2` tokens, so it runs in unit tests: the impl, or the errors
/// followed by a stub impl.
pub fn derive(input: TokenStream) -> TokenStream {
    match syn::parse2::<syn::DeriveInput>(input) {
        Ok(input) => derive_input(&input),
        Err(error) => error.to_compile_error(),
    }
}

fn derive_input(input: &syn::DeriveInput) -> TokenStream {
    let cx = Ctxt::new();
    let parsed = crate::ast::Input::from_ast(&cx, input);
    if let Some(parsed) = &parsed {
        check::check(&cx, parsed);
    }
    match (cx.check(), parsed) {
        (Ok(()), Some(parsed)) => expand(&parsed),
        (Err(errors), parsed) => {
            let krate = parsed
                .as_ref()
                .and_then(|p| p.attrs.krate.clone())
                .unwrap_or_else(default_crate);
            let stub = fallback(input, &krate);
            let errors = errors.to_compile_error();
            quote!(#errors #stub)
        }
        (Ok(()), None) => unreachable!("an input that could not be read always records an error"),
    }
}

fn default_crate() -> syn::Path {
    syn::parse_quote!(::module_runtime)
}

fn expand(input: &Input) -> TokenStream {
    let krate = input.attrs.krate.clone().unwrap_or_else(default_crate);
    let ident = input.ident;
    let mut generics = bound::with_bounds(input, &krate);
    if input.attrs.extra_repr.is_some() && !input.generics.params.is_empty() {
        // A generic type's `ExtraRepr` impl may need bounds of its own (`G: Gates`).
        let (_, ty_generics, _) = input.generics.split_for_impl();
        let predicate: syn::WherePredicate =
            syn::parse_quote!(#ident #ty_generics: #krate::ExtraRepr);
        generics.make_where_clause().predicates.push(predicate);
    }
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();

    let (visit, visit_mut, as_child) = match &input.data {
        Data::Struct(fields) => {
            let visit = fields.iter().map(|f| {
                let member = &f.member;
                visit_field(f, &krate, quote!(&self.#member), false)
            });
            let visit_mut = fields.iter().map(|f| {
                let member = &f.member;
                visit_field(f, &krate, quote!(&mut self.#member), true)
            });
            (
                quote!(#(#visit)*),
                quote!(#(#visit_mut)*),
                TokenStream::new(),
            )
        }
        Data::Enum(variants) => expand_enum(variants, &krate),
    };
    // `extra_state`: the type's own `ExtraState` impl, named at the attribute so that a missing
    // impl is reported there.
    let extra_state = input.attrs.extra_state.map(|span| {
        quote_spanned! {span=>
            fn extra_state(&self) -> ::core::option::Option<&dyn #krate::ExtraState> {
                ::core::option::Option::Some(self)
            }
        }
    });

    // `extra_repr`: the type's own `ExtraRepr` impl, named at the attribute like `extra_state`.
    let extra_repr = input.attrs.extra_repr.map(|span| {
        quote_spanned! {span=>
            fn extra_repr(&self) -> ::std::string::String {
                <Self as #krate::ExtraRepr>::extra_repr(self)
            }
            fn __repr_child(&self, child: &str) -> #krate::ChildRepr {
                <Self as #krate::ExtraRepr>::child_repr(self, child)
            }
            fn __repr_class(&self) -> ::core::option::Option<::std::string::String> {
                <Self as #krate::ExtraRepr>::class_repr(self)
            }
        }
    });
    // `print(model)`: `Display` is PyTorch's repr, unless the type has its own (`no_display`).
    let display = match input.attrs.no_display {
        Some(_) => TokenStream::new(),
        None => quote! {
            #[automatically_derived]
            impl #impl_generics ::core::fmt::Display for #ident #ty_generics #where_clause {
                fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
                    __f.write_str(&#krate::module_repr(self))
                }
            }
        },
    };

    let flattened = flattened(input, &krate);

    let class_name = class_name(input, &krate);

    let paths = match input.attrs.paths {
        Some(_) => crate::paths::expand(input, &krate),
        None => TokenStream::new(),
    };

    quote! {
        #paths

        #[automatically_derived]
        #[diagnostic::do_not_recommend]
        impl #impl_generics #krate::Module for #ident #ty_generics #where_clause {
            fn visit_children<'__module>(
                &'__module self,
                __f: &mut dyn ::core::ops::FnMut(#krate::Name<'_>, #krate::Child<'__module>),
            ) {
                #visit
            }

            fn visit_children_mut<'__module>(
                &'__module mut self,
                __f: &mut dyn ::core::ops::FnMut(#krate::Name<'_>, #krate::ChildMut<'__module>),
            ) {
                #visit_mut
            }

            #as_child

            #extra_state

            #extra_repr

            #flattened

            #class_name
        }

        #display
    }
}

/// `__flattened`, for a type with `#[module(flatten)]`ed fields: each one with its Rust name, so
/// that the runtime lifts their extra state and reports names that collide through them. Nothing
/// for the others (the trait's default lists none).
fn flattened(input: &Input, krate: &syn::Path) -> TokenStream {
    let name = |f: &Field| match &f.member {
        syn::Member::Named(ident) => ident.unraw().to_string(),
        syn::Member::Unnamed(index) => index.index.to_string(),
    };
    let is_flat = |f: &&Field| f.attrs.flatten.is_some();
    let body = match &input.data {
        Data::Struct(fields) => {
            let calls = fields.iter().filter(is_flat).map(|f| {
                let (member, name, ty) = (&f.member, name(f), f.ty);
                let value =
                    quote_spanned!(ty.span()=> <#ty as #krate::Module>::__as_dyn(&self.#member));
                quote!(__f(#name, #value);)
            });
            let calls: Vec<_> = calls.collect();
            if calls.is_empty() {
                return TokenStream::new();
            }
            quote!(#(#calls)*)
        }
        Data::Enum(variants) => {
            let arms: Vec<_> = variants
                .iter()
                .filter(|v| v.fields.iter().any(|f| is_flat(&f)))
                .map(|v| {
                    let ident = v.ident;
                    let flat: Vec<_> = v.fields.iter().filter(is_flat).collect();
                    let members = flat.iter().map(|f| &f.member);
                    let bindings: Vec<_> = (0..flat.len())
                        .map(|i| format_ident!("__field{}", i, span = Span::mixed_site()))
                        .collect();
                    let calls = flat.iter().zip(&bindings).map(|(f, b)| {
                        let (name, ty) = (name(f), f.ty);
                        let value =
                            quote_spanned!(ty.span()=> <#ty as #krate::Module>::__as_dyn(#b));
                        quote!(__f(#name, #value);)
                    });
                    quote! {
                        Self::#ident { #(#members: #bindings,)* .. } => { #(#calls)* }
                    }
                })
                .collect();
            if arms.is_empty() {
                return TokenStream::new();
            }
            quote! {
                #[allow(unreachable_patterns)]
                match self {
                    #(#arms)*
                    _ => {}
                }
            }
        }
    };
    quote! {
        fn __flattened<'__module>(
            &'__module self,
            __f: &mut dyn ::core::ops::FnMut(&'static str, &'__module dyn #krate::Module),
        ) {
            #body
        }
    }
}

/// `type_class_name` and `class_name`: the `#[module(class_name = ...)]` expression, or for a generic
/// type whose fields include a bare type parameter (`layer: L`, which the impl requires to be a
/// module), the Rust name with those arguments shown by their class names (`Block<Conv2d>`).
/// Nothing for the others: the trait's defaults (the Rust name without paths) already agree.
fn class_name(input: &Input, krate: &syn::Path) -> TokenStream {
    let body = match &input.attrs.class_name {
        Some(expr) => quote_spanned! {expr.span()=>
            ::core::convert::Into::<::std::string::String>::into(#expr)
        },
        None => {
            let params: Vec<&syn::Ident> = input
                .generics
                .type_params()
                .map(|p| &p.ident)
                .filter(|param| input.all_fields().any(|f| is_walked_param(f, param)))
                .collect();
            if params.is_empty() {
                return TokenStream::new();
            }
            quote! {
                #krate::generic_class_name(
                    ::core::any::type_name::<Self>(),
                    &[#((
                        ::core::any::type_name::<#params>(),
                        <#params as #krate::Module>::type_class_name(),
                    )),*],
                )
            }
        }
    };
    quote! {
        fn type_class_name() -> ::std::string::String {
            #body
        }
        fn class_name(&self) -> ::std::string::String {
            <Self as #krate::Module>::type_class_name()
        }
    }
}

/// Whether `field` is walked and its type is exactly the type parameter `param`.
fn is_walked_param(field: &Field, param: &syn::Ident) -> bool {
    let syn::Type::Path(ty) = field.ty else {
        return false;
    };
    field.attrs.skip.is_none() && ty.qself.is_none() && ty.path.is_ident(param)
}

/// One field's part of the walk. The trait is named through the field's type, spanned at it, so a
/// type that is not a module gets one error, pointing at that type.
fn visit_field(field: &Field, krate: &syn::Path, place: TokenStream, mutable: bool) -> TokenStream {
    if field.attrs.skip.is_some() {
        return TokenStream::new();
    }
    let ty = field.ty;
    let span = ty.span();
    if field.attrs.flatten.is_some() {
        let method = if mutable {
            quote!(visit_children_mut)
        } else {
            quote!(visit_children)
        };
        return quote_spanned!(span=> <#ty as #krate::Module>::#method(#place, __f););
    }
    let name = match (&field.attrs.rename, &field.member) {
        (None, syn::Member::Unnamed(index)) => {
            let index = index.index as usize;
            quote!(#krate::Name::Index(#index))
        }
        _ => {
            let name = field.path_name();
            quote!(#krate::Name::Field(#name))
        }
    };
    let method = if mutable {
        quote!(as_child_mut)
    } else {
        quote!(as_child)
    };
    let child = quote_spanned!(span=> <#ty as #krate::Module>::#method(#place));
    quote!(__f(#name, #child);)
}

/// Enums: a variant's fields are the children (the variant name is not a path segment, so a
/// checkpoint's names do not depend on which variant is built). A variant with exactly one
/// unnamed field is transparent: the enum *is* that field at its path, like `Option`.
fn expand_enum(variants: &[Variant], krate: &syn::Path) -> (TokenStream, TokenStream, TokenStream) {
    let mut visit = Vec::new();
    let mut visit_mut = Vec::new();
    let mut as_child = Vec::new();
    let mut as_child_mut = Vec::new();
    for variant in variants {
        let ident = variant.ident;
        let bindings: Vec<syn::Ident> = (0..variant.fields.len())
            .map(|i| format_ident!("__field{}", i, span = Span::mixed_site()))
            .collect();
        // Skipped fields are matched by `_`, so that no binding goes unused.
        let patterns = variant.fields.iter().zip(&bindings).map(|(f, b)| {
            if f.attrs.skip.is_some() {
                quote!(_)
            } else {
                quote!(#b)
            }
        });
        let pattern = match variant.style {
            Style::Unit => quote!(Self::#ident),
            Style::Tuple => quote!(Self::#ident(#(#patterns),*)),
            Style::Named => {
                let members = variant.fields.iter().map(|f| &f.member);
                quote!(Self::#ident { #(#members: #patterns),* })
            }
        };
        if let Some(field) = transparent_field(variant) {
            let ty = field.ty;
            let b = &bindings[0];
            let span = ty.span();
            visit.push(quote_spanned!(span=> #pattern => <#ty as #krate::Module>::visit_children(#b, __f),));
            visit_mut.push(
                quote_spanned!(span=> #pattern => <#ty as #krate::Module>::visit_children_mut(#b, __f),),
            );
            as_child
                .push(quote_spanned!(span=> #pattern => <#ty as #krate::Module>::as_child(#b),));
            as_child_mut.push(
                quote_spanned!(span=> #pattern => <#ty as #krate::Module>::as_child_mut(#b),),
            );
            continue;
        }
        let fields = variant.fields.iter().zip(&bindings);
        let body: Vec<_> = fields
            .clone()
            .map(|(f, b)| visit_field(f, krate, quote!(#b), false))
            .collect();
        let body_mut: Vec<_> = fields
            .map(|(f, b)| visit_field(f, krate, quote!(#b), true))
            .collect();
        visit.push(quote!(#pattern => { #(#body)* }));
        visit_mut.push(quote!(#pattern => { #(#body_mut)* }));
    }
    let visit = quote!(match self { #(#visit)* });
    let visit_mut = quote!(match self { #(#visit_mut)* });
    let as_child = if as_child.is_empty() {
        TokenStream::new()
    } else {
        quote! {
            fn as_child(&self) -> #krate::Child<'_> {
                #[allow(unreachable_patterns)]
                match self {
                    #(#as_child)*
                    _ => #krate::Child::Module { module: self, shared: ::core::option::Option::None },
                }
            }

            fn as_child_mut(&mut self) -> #krate::ChildMut<'_> {
                #[allow(unreachable_patterns)]
                match self {
                    #(#as_child_mut)*
                    _ => #krate::ChildMut::Module(self),
                }
            }
        }
    };
    (visit, visit_mut, as_child)
}

fn transparent_field<'v, 'a>(variant: &'v Variant<'a>) -> Option<&'v Field<'a>> {
    match (variant.style, variant.fields.as_slice()) {
        (Style::Tuple, [field])
            if field.attrs.skip.is_none()
                && field.attrs.rename.is_none()
                && field.attrs.flatten.is_none() =>
        {
            Some(field)
        }
        _ => None,
    }
}

/// After an error: an impl with no children, so that uses of the type do not add follow-on errors.
fn fallback(input: &syn::DeriveInput, krate: &syn::Path) -> TokenStream {
    let ident = &input.ident;
    let mut generics = input.generics.clone();
    let lifetimes: Vec<_> = generics.lifetimes().map(|l| l.lifetime.clone()).collect();
    let params: Vec<_> = generics.type_params().map(|p| p.ident.clone()).collect();
    let where_clause = generics.make_where_clause();
    for l in lifetimes {
        where_clause.predicates.push(syn::parse_quote!(#l: 'static));
    }
    for p in params {
        where_clause.predicates.push(syn::parse_quote!(
            #p: ::core::marker::Send + ::core::marker::Sync + 'static
        ));
    }
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    quote! {
        #[automatically_derived]
        #[diagnostic::do_not_recommend]
        impl #impl_generics #krate::Module for #ident #ty_generics #where_clause {
            fn visit_children<'__module>(
                &'__module self,
                _: &mut dyn ::core::ops::FnMut(#krate::Name<'_>, #krate::Child<'__module>),
            ) {
            }

            fn visit_children_mut<'__module>(
                &'__module mut self,
                _: &mut dyn ::core::ops::FnMut(#krate::Name<'_>, #krate::ChildMut<'__module>),
            ) {
            }
        }
    }
}
