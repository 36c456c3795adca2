#[automatically_derived]
#[diagnostic::do_not_recommend]
impl<const D: usize> ::module_runtime::Module for Conv<D> {
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::Child<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("weight"),
            <Param as ::module_runtime::Module>::as_child(&self.weight),
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
            ::module_runtime::Name::Field("weight"),
            <Param as ::module_runtime::Module>::as_child_mut(&mut self.weight),
        );
    }
    fn type_class_name() -> ::std::string::String {
        ::core::convert::Into::<::std::string::String>::into(format!("Conv{D}d"))
    }
    fn class_name(&self) -> ::std::string::String {
        <Self as ::module_runtime::Module>::type_class_name()
    }
}
#[automatically_derived]
impl<const D: usize> ::core::fmt::Display for Conv<D> {
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&::module_runtime::module_repr(self))
    }
}
