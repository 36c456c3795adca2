#[automatically_derived]
#[diagnostic::do_not_recommend]
impl ::module_runtime::Module for Pair {
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::Child<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Index(0usize),
            <Linear as ::module_runtime::Module>::as_child(&self.0),
        );
        __f(
            ::module_runtime::Name::Index(1usize),
            <Linear as ::module_runtime::Module>::as_child(&self.1),
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
            ::module_runtime::Name::Index(0usize),
            <Linear as ::module_runtime::Module>::as_child_mut(&mut self.0),
        );
        __f(
            ::module_runtime::Name::Index(1usize),
            <Linear as ::module_runtime::Module>::as_child_mut(&mut self.1),
        );
    }
}
#[automatically_derived]
impl ::core::fmt::Display for Pair {
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&::module_runtime::module_repr(self))
    }
}
