#[automatically_derived]
#[diagnostic::do_not_recommend]
impl<L, S> ::module_runtime::Module for Block<L, S>
where
    L: 'static,
    S: 'static,
    L: ::module_runtime::Module,
    S: ::core::marker::Send + ::core::marker::Sync + 'static,
{
    fn visit_children<'__module>(
        &'__module self,
        __f: &mut dyn ::core::ops::FnMut(
            ::module_runtime::Name<'_>,
            ::module_runtime::Child<'__module>,
        ),
    ) {
        __f(
            ::module_runtime::Name::Field("layer"),
            <L as ::module_runtime::Module>::as_child(&self.layer),
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
            ::module_runtime::Name::Field("layer"),
            <L as ::module_runtime::Module>::as_child_mut(&mut self.layer),
        );
    }
    fn type_class_name() -> ::std::string::String {
        ::module_runtime::generic_class_name(
            ::core::any::type_name::<Self>(),
            &[
                (
                    ::core::any::type_name::<L>(),
                    <L as ::module_runtime::Module>::type_class_name(),
                ),
            ],
        )
    }
    fn class_name(&self) -> ::std::string::String {
        <Self as ::module_runtime::Module>::type_class_name()
    }
}
#[automatically_derived]
impl<L, S> ::core::fmt::Display for Block<L, S>
where
    L: 'static,
    S: 'static,
    L: ::module_runtime::Module,
    S: ::core::marker::Send + ::core::marker::Sync + 'static,
{
    fn fmt(&self, __f: &mut ::core::fmt::Formatter<'_>) -> ::core::fmt::Result {
        __f.write_str(&::module_runtime::module_repr(self))
    }
}
