#[automatically_derived]
#[diagnostic::do_not_recommend]
impl<'a, T, U: Clone, const N: usize> ::module_runtime::Module for Encoder<'a, T, U, N>
where
    'a: 'static,
    T: 'static,
    U: 'static,
    Vec<T>: ::module_runtime::Module,
    Option<U>: ::module_runtime::Module,
    &'a T: ::core::marker::Send + ::core::marker::Sync + 'static,
{
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::Child<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("layers"),
            <Vec<T> as ::module_runtime::Module>::as_child(&self.layers),
        );
        __f(
            ::module_runtime::Name::Field("head"),
            <Option<U> as ::module_runtime::Module>::as_child(&self.head),
        );
        __f(
            ::module_runtime::Name::Field("norms"),
            <[LayerNorm; N] as ::module_runtime::Module>::as_child(&self.norms),
        );
    }
    fn visit_children_mut<'__module>(
        &'__module mut self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::ChildMut<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("layers"),
            <Vec<T> as ::module_runtime::Module>::as_child_mut(&mut self.layers),
        );
        __f(
            ::module_runtime::Name::Field("head"),
            <Option<U> as ::module_runtime::Module>::as_child_mut(&mut self.head),
        );
        __f(
            ::module_runtime::Name::Field("norms"),
            <[LayerNorm; N] as ::module_runtime::Module>::as_child_mut(&mut self.norms),
        );
    }
}
#[automatically_derived]
impl<'a, T, U: Clone, const N: usize> ::core::fmt::Display for Encoder<'a, T, U, N>
where
    'a: 'static,
    T: 'static,
    U: 'static,
    Vec<T>: ::module_runtime::Module,
    Option<U>: ::module_runtime::Module,
    &'a T: ::core::marker::Send + ::core::marker::Sync + 'static,
{
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&::module_runtime::module_repr(self))
    }
}
