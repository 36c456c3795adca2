///Typed paths into a [`Block`] (from `#[module(paths)]`): one method per field, starting from [`Block::path()`]. `R` is the root type, `K` the [`PathKind`](module_runtime::typed_path::PathKind). Dereferences to [`Path`](module_runtime::typed_path::Path), and so to `str`, the state-dict path.
#[allow(dead_code)]
pub struct BlockPath<__R: 'static, __K: ::module_runtime::typed_path::PathKind> {
    __path: ::module_runtime::typed_path::Path<__R, __K, Block>,
}
#[automatically_derived]
impl<__R: 'static, __K: ::module_runtime::typed_path::PathKind> ::core::clone::Clone
for BlockPath<__R, __K> {
    fn clone(&self) -> Self {
        Self {
            __path: ::core::clone::Clone::clone(&self.__path),
        }
    }
}
#[automatically_derived]
impl<__R: 'static, __K: ::module_runtime::typed_path::PathKind> ::core::ops::Deref
for BlockPath<__R, __K> {
    type Target = ::module_runtime::typed_path::Path<__R, __K, Block>;
    fn deref(&self) -> &Self::Target {
        &self.__path
    }
}
#[automatically_derived]
impl<__R: 'static, __K: ::module_runtime::typed_path::PathKind> ::core::fmt::Display
for BlockPath<__R, __K> {
    fn fmt(&self, f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        ::core::fmt::Display::fmt(&self.__path, f)
    }
}
#[automatically_derived]
impl<
    __R: 'static,
    __K: ::module_runtime::typed_path::PathKind,
> ::module_runtime::typed_path::FromPathString for BlockPath<__R, __K> {
    fn __from_path_string(path: ::std::string::String) -> Self {
        Self {
            __path: ::module_runtime::typed_path::FromPathString::__from_path_string(
                path,
            ),
        }
    }
}
#[automatically_derived]
impl<
    __R: 'static,
    __K: ::module_runtime::typed_path::PathKind,
> ::module_runtime::typed_path::TypedPath for BlockPath<__R, __K>
where
    Block: 'static,
{
    type Root = __R;
    type Target = Block;
    type Kind = __K;
    fn as_str(&self) -> &str {
        self.__path.as_str()
    }
}
#[automatically_derived]
impl ::module_runtime::typed_path::HasPath for Block
where
    Block: 'static,
{
    type Path<__R: 'static, __K: ::module_runtime::typed_path::PathKind> = BlockPath<
        __R,
        __K,
    >;
}
#[automatically_derived]
#[allow(dead_code)]
impl Block
where
    Block: 'static,
{
    ///The typed path of a [`Block`] itself (the empty path): navigate from it with the methods of [`BlockPath`]; its string form is the state-dict path.
    pub fn path() -> BlockPath<Self, ::module_runtime::typed_path::Static> {
        ::module_runtime::typed_path::__root()
    }
    /// The module (or parameter, or buffer) a typed path from this type leads to: `&T`
    /// for a path that always exists, `Option<&T>` for one through an index, a key or an
    /// `Option`, every match for a pattern (`each()`).
    pub fn get<__P>(
        &self,
        path: __P,
    ) -> <<__P as ::module_runtime::typed_path::TypedPath>::Kind as ::module_runtime::typed_path::Resolve>::Output<
        '_,
        <__P as ::module_runtime::typed_path::TypedPath>::Target,
    >
    where
        __P: ::module_runtime::typed_path::TypedPath<Root = Self>,
        <__P as ::module_runtime::typed_path::TypedPath>::Kind: ::module_runtime::typed_path::Resolve,
        Self: ::module_runtime::Module + ::core::marker::Sized,
    {
        ::module_runtime::typed_path::PathExt::get(self, path)
    }
    /// [`get`](Self::get), mutably: `&mut T`, `Option<&mut T>` or every match; not
    /// offered for a path through an `Arc`, which has no `&mut`.
    pub fn get_mut<__P>(
        &mut self,
        path: __P,
    ) -> <<__P as ::module_runtime::typed_path::TypedPath>::Kind as ::module_runtime::typed_path::ResolveMut>::OutputMut<
        '_,
        <__P as ::module_runtime::typed_path::TypedPath>::Target,
    >
    where
        __P: ::module_runtime::typed_path::TypedPath<Root = Self>,
        <__P as ::module_runtime::typed_path::TypedPath>::Kind: ::module_runtime::typed_path::ResolveMut,
        Self: ::module_runtime::Module + ::core::marker::Sized,
    {
        ::module_runtime::typed_path::PathExt::get_mut(self, path)
    }
}
#[automatically_derived]
#[allow(dead_code, private_interfaces, private_bounds)]
impl<__R: 'static, __K: ::module_runtime::typed_path::PathKind> BlockPath<__R, __K> {
    ///The path of the field `norm`: segment `LayerNorm`.
    #[inline]
    pub fn norm(
        &self,
    ) -> <LayerNorm as ::module_runtime::typed_path::HasPath>::Path<
        __R,
        <__K as ::module_runtime::typed_path::PathKind>::Field,
    >
    where
        LayerNorm: ::module_runtime::typed_path::HasPath,
    {
        ::module_runtime::typed_path::FromPathString::__from_path_string(
            ::module_runtime::typed_path::__child_name(self.__path.as_str(), "LayerNorm"),
        )
    }
    ///The path of the field `layers`: segment `layers`.
    #[inline]
    pub fn layers(
        &self,
    ) -> <Vec<
        Linear,
    > as ::module_runtime::typed_path::HasPath>::Path<
        __R,
        <__K as ::module_runtime::typed_path::PathKind>::Field,
    >
    where
        Vec<Linear>: ::module_runtime::typed_path::HasPath,
    {
        ::module_runtime::typed_path::FromPathString::__from_path_string(
            ::module_runtime::typed_path::__child_name(self.__path.as_str(), "layers"),
        )
    }
    ///The path of the `#[module(flatten)]` field `inner`: the same string as this one's (a flattened field adds no segment), as a prefix for its children.
    #[inline]
    pub fn inner(
        &self,
    ) -> <Inner as ::module_runtime::typed_path::HasPath>::Path<
        __R,
        ::module_runtime::typed_path::Flat<
            <__K as ::module_runtime::typed_path::PathKind>::Field,
        >,
    >
    where
        Inner: ::module_runtime::typed_path::HasPath,
    {
        ::module_runtime::typed_path::FromPathString::__from_path_string(
            ::std::string::ToString::to_string(self.__path.as_str()),
        )
    }
}
#[automatically_derived]
#[diagnostic::do_not_recommend]
impl ::module_runtime::Module for Block {
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::Child<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("LayerNorm"),
            <LayerNorm as ::module_runtime::Module>::as_child(&self.norm),
        );
        __f(
            ::module_runtime::Name::Field("layers"),
            <Vec<Linear> as ::module_runtime::Module>::as_child(&self.layers),
        );
        <Inner as ::module_runtime::Module>::visit_children(&self.inner, __f);
    }
    fn visit_children_mut<'__module>(
        &'__module mut self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::ChildMut<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("LayerNorm"),
            <LayerNorm as ::module_runtime::Module>::as_child_mut(&mut self.norm),
        );
        __f(
            ::module_runtime::Name::Field("layers"),
            <Vec<Linear> as ::module_runtime::Module>::as_child_mut(&mut self.layers),
        );
        <Inner as ::module_runtime::Module>::visit_children_mut(&mut self.inner, __f);
    }
    fn __flattened<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            &'static str,
            &'__module dyn ::module_runtime::Module,
        ),
    ) {
        __f("inner", <Inner as ::module_runtime::Module>::__as_dyn(&self.inner));
    }
}
#[automatically_derived]
impl ::core::fmt::Display for Block {
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&::module_runtime::module_repr(self))
    }
}
