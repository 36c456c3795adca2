//! The input as our own types, borrowing from `syn::DeriveInput`.

use syn::ext::IdentExt;
use syn::spanned::Spanned;

use crate::attr;
use crate::ctxt::Ctxt;

pub struct Input<'a> {
    pub ident: &'a syn::Ident,
    pub vis: &'a syn::Visibility,
    pub generics: &'a syn::Generics,
    pub attrs: attr::Container,
    pub data: Data<'a>,
}

pub enum Data<'a> {
    Struct(Vec<Field<'a>>),
    Enum(Vec<Variant<'a>>),
}

pub struct Variant<'a> {
    pub ident: &'a syn::Ident,
    pub style: Style,
    pub fields: Vec<Field<'a>>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Style {
    Named,
    Tuple,
    Unit,
}

pub struct Field<'a> {
    /// `self.<member>`: a name or a position.
    pub member: syn::Member,
    pub ty: &'a syn::Type,
    pub attrs: attr::Field,
    /// Where errors about the whole field point.
    pub span: proc_macro2::Span,
}

impl Field<'_> {
    /// The field's name in paths: its `rename`, its identifier, or its position.
    pub fn path_name(&self) -> String {
        match (&self.attrs.rename, &self.member) {
            (Some((_, name)), _) => name.clone(),
            (None, syn::Member::Named(ident)) => ident.unraw().to_string(),
            (None, syn::Member::Unnamed(index)) => index.index.to_string(),
        }
    }
}

impl<'a> Input<'a> {
    /// Reads the input; `None` (with errors recorded) for unions.
    pub fn from_ast(cx: &Ctxt, input: &'a syn::DeriveInput) -> Option<Self> {
        let attrs = attr::Container::from_ast(cx, &input.attrs);
        let data = match &input.data {
            syn::Data::Struct(s) => Data::Struct(fields(cx, &s.fields)),
            syn::Data::Enum(e) => Data::Enum(
                e.variants
                    .iter()
                    .map(|v| {
                        attr::reject_variant_attrs(cx, &v.attrs);
                        Variant {
                            ident: &v.ident,
                            style: style(&v.fields),
                            fields: fields(cx, &v.fields),
                        }
                    })
                    .collect(),
            ),
            syn::Data::Union(u) => {
                cx.error_spanned_by(
                    u.union_token,
                    "`#[derive(Module)]` does not support unions: a walk cannot know which field \
                     is live; use an enum",
                );
                return None;
            }
        };
        Some(Self {
            ident: &input.ident,
            vis: &input.vis,
            generics: &input.generics,
            attrs,
            data,
        })
    }

    /// Every field, of every variant.
    pub fn all_fields(&self) -> Box<dyn Iterator<Item = &Field<'a>> + '_> {
        match &self.data {
            Data::Struct(fields) => Box::new(fields.iter()),
            Data::Enum(variants) => Box::new(variants.iter().flat_map(|v| v.fields.iter())),
        }
    }
}

fn style(fields: &syn::Fields) -> Style {
    match fields {
        syn::Fields::Named(_) => Style::Named,
        syn::Fields::Unnamed(_) => Style::Tuple,
        syn::Fields::Unit => Style::Unit,
    }
}

fn fields<'a>(cx: &Ctxt, fields: &'a syn::Fields) -> Vec<Field<'a>> {
    fields
        .iter()
        .enumerate()
        .map(|(i, f)| Field {
            member: member(i, f),
            ty: &f.ty,
            attrs: attr::Field::from_ast(cx, &f.attrs),
            span: f.ident.as_ref().map_or_else(|| f.ty.span(), |i| i.span()),
        })
        .collect()
}

/// How the `i`-th field is named in `self.<member>`: its identifier, or its position.
pub fn member(i: usize, field: &syn::Field) -> syn::Member {
    match &field.ident {
        Some(ident) => syn::Member::Named(ident.clone()),
        None => syn::Member::Unnamed(syn::Index {
            index: i as u32,
            span: field.ty.span(),
        }),
    }
}
