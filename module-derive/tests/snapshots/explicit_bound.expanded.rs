#[automatically_derived]
#[diagnostic::do_not_recommend]
impl<B: Backbone> ::module_runtime::Module for Net<B>
where
    B: 'static,
    B::Layer: Module,
{
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::Child<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("body"),
            <B::Layer as ::module_runtime::Module>::as_child(&self.body),
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
            ::module_runtime::Name::Field("body"),
            <B::Layer as ::module_runtime::Module>::as_child_mut(&mut self.body),
        );
    }
}
#[automatically_derived]
impl<B: Backbone> ::core::fmt::Display for Net<B>
where
    B: 'static,
    B::Layer: Module,
{
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&::module_runtime::module_repr(self))
    }
}
