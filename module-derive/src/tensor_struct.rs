//! `#[derive(TensorStruct)]`: a struct whose fields are tensors or tensor trees, walked in field
//! order. Like the `Module` derive, it emits only the structural walk; what a tree is lives in the
//! runtime (`TensorTree`). Its stages are the `Module` derive's: `attr` reads the `#[tensor(...)]`
//! attributes, `check` refuses what it cannot derive, and this file generates the impl.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::spanned::Spanned;

use crate::ctxt::Ctxt;
use crate::{attr, check};

/// The derive on `proc_macro2` tokens: the impl, or the errors followed by a stub impl that keeps
/// uses of the type from adding follow-on errors.
pub fn derive(input: TokenStream) -> TokenStream {
    let input = match syn::parse2::<syn::DeriveInput>(input) {
        Ok(input) => input,
        Err(error) => return error.to_compile_error(),
    };
    let cx = Ctxt::new();
    let fields = read(&cx, &input);
    match (cx.check(), fields) {
        (Ok(()), Some(fields)) => expand(&input, &fields),
        (Err(errors), _) => {
            let errors = errors.to_compile_error();
            let stub = stub(&input);
            quote!(#errors #stub)
        }
        (Ok(()), None) => unreachable!("an input that could not be read always records an error"),
    }
}

struct Field<'a> {
    member: syn::Member,
    ty: &'a syn::Type,
    skip: bool,
}

/// The struct's fields with their `#[tensor(...)]` attributes (read by `attr`); `None` (with an
/// error, from `check`) for enums and unions.
fn read<'a>(cx: &Ctxt, input: &'a syn::DeriveInput) -> Option<Vec<Field<'a>>> {
    attr::reject_tensor_type_attrs(cx, &input.attrs);
    let fields = check::tensor_struct_fields(cx, input)?;
    let fields = fields
        .iter()
        .enumerate()
        .map(|(i, f)| Field {
            member: crate::ast::member(i, f),
            ty: &f.ty,
            skip: attr::TensorField::from_ast(cx, &f.attrs).skip.is_some(),
        })
        .collect();
    Some(fields)
}

/// The generics with `'static` for every parameter (a `TensorStruct` is `'static`) and
/// `Field: TensorTree` for every walked field whose type mentions a type parameter.
fn generics(input: &syn::DeriveInput, fields: &[Field], krate: &TokenStream) -> syn::Generics {
    let (mut generics, params) = crate::bound::all_static(&input.generics);
    let where_clause = generics.make_where_clause();
    for field in fields.iter().filter(|f| !f.skip) {
        let ty = field.ty;
        if crate::bound::mentions_any(ty, &params) {
            let predicate = quote_spanned!(ty.span()=> #ty: #krate::TensorTree);
            where_clause.predicates.push(syn::parse_quote!(#predicate));
        }
    }
    generics
}

fn expand(input: &syn::DeriveInput, fields: &[Field]) -> TokenStream {
    let krate = quote!(::module_runtime);
    let ident = &input.ident;
    let generics = generics(input, fields, &krate);
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let tensor = quote!(#krate::candle_core::Tensor);
    let bindings: Vec<syn::Ident> = (0..fields.len())
        .map(|i| format_ident!("__field{}", i, span = Span::mixed_site()))
        .collect();
    let members: Vec<&syn::Member> = fields.iter().map(|f| &f.member).collect();
    // The trait is named through the field's type, spanned at it, so a field that is not a tensor
    // tree gets one error, pointing at its type.
    let visit = fields.iter().filter(|f| !f.skip).map(|f| {
        let (ty, member) = (f.ty, &f.member);
        quote_spanned!(ty.span()=> <#ty as #krate::TensorTree>::for_each_tensor(&self.#member, __f);)
    });
    let rebuilt = fields.iter().zip(&bindings).map(|(f, b)| {
        let ty = f.ty;
        if f.skip {
            quote!(#b)
        } else {
            quote_spanned!(ty.span()=> #krate::__private::map_tree::<#ty>(#b, __f))
        }
    });
    quote! {
        #[automatically_derived]
        impl #impl_generics #krate::TensorStruct for #ident #ty_generics #where_clause {
            fn for_each_tensor(&self, __f: &mut dyn ::core::ops::FnMut(&#tensor)) {
                #(#visit)*
            }

            fn map_tensors(
                self,
                __f: &mut dyn ::core::ops::FnMut(#tensor) -> #tensor,
            ) -> Self {
                let Self { #(#members: #bindings),* } = self;
                Self { #(#members: #rebuilt),* }
            }

            fn clone_tree(&self) -> ::core::option::Option<Self> {
                #[allow(unused_imports)]
                use #krate::__private::{ViaClone as _, ViaNone as _};
                (&#krate::__private::CloneProbe(self)).clone_tree()
            }
        }
    }
}

/// After an error: an impl with no tensors. Enums and unions get none (they have no `Self { }`).
fn stub(input: &syn::DeriveInput) -> TokenStream {
    if !matches!(input.data, syn::Data::Struct(_)) {
        return TokenStream::new();
    }
    let krate = quote!(::module_runtime);
    let ident = &input.ident;
    let generics = generics(input, &[], &krate);
    let (impl_generics, ty_generics, where_clause) = generics.split_for_impl();
    let tensor = quote!(#krate::candle_core::Tensor);
    quote! {
        #[automatically_derived]
        impl #impl_generics #krate::TensorStruct for #ident #ty_generics #where_clause {
            fn for_each_tensor(&self, _: &mut dyn ::core::ops::FnMut(&#tensor)) {}

            fn map_tensors(self, _: &mut dyn ::core::ops::FnMut(#tensor) -> #tensor) -> Self {
                self
            }
        }
    }
}
