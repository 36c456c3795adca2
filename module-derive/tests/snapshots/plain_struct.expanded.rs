#[automatically_derived]
#[diagnostic::do_not_recommend]
impl ::module_runtime::Module for Mlp {
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::Child<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("fc1"),
            <Linear as ::module_runtime::Module>::as_child(&self.fc1),
        );
        __f(
            ::module_runtime::Name::Field("fc2"),
            <Linear as ::module_runtime::Module>::as_child(&self.fc2),
        );
        __f(
            ::module_runtime::Name::Field("dropout"),
            <f64 as ::module_runtime::Module>::as_child(&self.dropout),
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
            ::module_runtime::Name::Field("fc1"),
            <Linear as ::module_runtime::Module>::as_child_mut(&mut self.fc1),
        );
        __f(
            ::module_runtime::Name::Field("fc2"),
            <Linear as ::module_runtime::Module>::as_child_mut(&mut self.fc2),
        );
        __f(
            ::module_runtime::Name::Field("dropout"),
            <f64 as ::module_runtime::Module>::as_child_mut(&mut self.dropout),
        );
    }
}
#[automatically_derived]
impl ::core::fmt::Display for Mlp {
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&::module_runtime::module_repr(self))
    }
}
